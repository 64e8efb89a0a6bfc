"""megatron_ext: synchronization-free rowwise expert parallelism for Megatron-Core MoE.

Drop-in parts registered through Megatron's spec system (see README.md):
`megatron_ext.specs` for layer/block specs, `megatron_ext.config.MoEExtConfig` for settings.
"""

__version__ = "0.1.0"
MEGATRON_CORE_VERSION = "0.19.2"  # the release every Megatron internal here was written against
