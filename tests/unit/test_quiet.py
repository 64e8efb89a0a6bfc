"""quiet.py: the entry points hide exactly Megatron's known-harmless warnings, once, and say so in one line;
warn_once says a fallback once per logger and message."""

import logging
import warnings

import pytest

from megatron_ext import quiet

# As Megatron-Core 0.19.2 and torch word them (the filters match their starts).
HARMLESS = [
    "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
    "Apex is not installed. Falling back to Torch Norm",
    "Only transformer-engine>=1.7.0 supports MoE experts, but your environment has none.",
]
OTHER = ["Apex is installed but broken", "a warning megatron_ext knows nothing about"]


@pytest.fixture(autouse=True)
def _restored(monkeypatch):
    """Each test starts before any filter was installed; the loggers' levels come back afterwards."""
    monkeypatch.setattr(quiet, "_done", False)
    for name, _ in quiet._LOGGERS:
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)


def _warned(messages):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # quiet's filters, installed next, go in front of this one
        quiet.quiet_known_warnings(announce=False)
        for message in messages:
            warnings.warn(message, UserWarning)
    return [str(w.message) for w in caught]


def test_only_the_known_messages_are_hidden_and_loggers_raised_to_errors():
    assert _warned(HARMLESS + OTHER) == OTHER
    # the CUDA_HOME notice is a warning: no longer shown
    assert logging.getLogger("torch.utils.cpp_extension").level == logging.ERROR


def test_the_filters_are_installed_and_announced_once(monkeypatch, capsys):
    with warnings.catch_warnings():
        quiet.quiet_known_warnings()
        installed = len(warnings.filters)
        quiet.quiet_known_warnings()
        assert len(warnings.filters) == installed
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("megatron_ext: hiding known-harmless warnings")
    monkeypatch.setattr(quiet, "_done", False)
    with warnings.catch_warnings():
        quiet.quiet_known_warnings(announce=False)  # ranks other than 0 install the filters silently
    assert capsys.readouterr().err == ""


def test_warn_once_is_once_per_logger_and_message(monkeypatch):
    monkeypatch.setattr(quiet, "_WARNED", set())
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append((record.name, record.getMessage()))
    first, second = logging.getLogger("megatron_ext.test_quiet.a"), logging.getLogger("megatron_ext.test_quiet.b")
    for logger in (first, second):
        logger.addHandler(handler)
    try:
        for _ in range(3):
            quiet.warn_once(first, "fallback")
            quiet.warn_once(second, "fallback")
            quiet.warn_once(first, "another")
    finally:
        for logger in (first, second):
            logger.removeHandler(handler)
    assert said == [("megatron_ext.test_quiet.a", "fallback"), ("megatron_ext.test_quiet.b", "fallback"),
                    ("megatron_ext.test_quiet.a", "another")]
