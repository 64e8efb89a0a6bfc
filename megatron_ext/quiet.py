"""Hide the warnings megatron_ext's entry points know to be harmless, and say so in one line.

On a machine without Transformer Engine, Apex or absl (the CPU machines, the lent GPUs),
importing Megatron-Core prints ~20 warning lines per process about fallbacks it then uses
correctly; torch adds a CUDA_HOME notice on CPU-only hosts. They bury the lines a user needs.
`quiet_known_warnings()` filters exactly those messages (nothing else) and prints one line
naming what it filtered. Entry points call it before importing Megatron; importing
megatron_ext itself changes no filter.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings

# (start of the message, why it is harmless here)
KNOWN_HARMLESS = (
    ("Transformer Engine and Apex are not installed", "Megatron falls back to torch implementations"),
    ("Apex is not installed. Falling back to Torch Norm", "Megatron uses torch's norm"),
    ("absl.logging is not installed", "Megatron uses the logging module"),
    ("full scope is deprecated", "raised by Megatron's own TransformerConfig defaults"),
    ("`torch.distributed.all_gather_into_tensor` is deprecated", "torch's rename, raised by Megatron's calls"),
    ("Only transformer-engine>=1.7.0 supports MoE experts",
     "raised by Megatron's TE spec provider without TE; it builds SequentialMLP, and megatron_ext's specs put the "
     "grouped experts in its place"),
)
_LOGGERS = (
    ("torch.utils.cpp_extension", "the CUDA_HOME notice on hosts without a CUDA runtime"),
    ("megatron.core.models.gpt.gpt_model",
     "GPTModel's deprecation notice (it is Megatron's supported GPT model in 0.19)"),
)
_done = False


def quiet_known_warnings(announce: bool = True) -> None:
    """Install the filters (idempotent) and print one line to stderr saying what is hidden."""
    global _done
    if _done:
        return
    _done = True
    for start, _ in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=re.escape(start))
    for name, _ in _LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    if announce:
        print("megatron_ext: hiding known-harmless warnings (Transformer Engine/Apex/absl absent, CUDA_HOME notice, "
              "deprecation notices of Megatron and torch; list in megatron_ext/quiet.py)", file=sys.stderr)


_WARNED: set[tuple[str, str]] = set()


def warn_once(logger: logging.Logger, message: str) -> None:
    """logger.warning(message) the first time this logger gets this message in the process: a
    configuration fallback is said once, not once per layer."""
    key = (logger.name, message)
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)
