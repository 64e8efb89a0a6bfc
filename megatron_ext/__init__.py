"""megatron_ext: synchronization-free rowwise expert parallelism for Megatron-Core MoE.

Drop-in parts registered through Megatron's spec system (see README.md):
`megatron_ext.specs` for layer/block specs, `megatron_ext.config.MoEExtConfig` for settings.
"""

from megatron_ext.rules import MEGATRON_VERSION as MEGATRON_CORE_VERSION  # noqa: F401 - the release every internal was written against

__version__ = "0.1.0"
