"""bench/host_census.py: in-step host time per named function, with the originals put back."""

import sys
import types

import pytest

from megatron_ext.bench.host_census import ROWWISE_TARGETS, _resolve, function_census


_clock = [0.0]  # a simulated perf_counter: the census's figures stay exact on a loaded CI machine


def _busy(seconds: float) -> None:
    _clock[0] += seconds


@pytest.fixture(autouse=True)
def simulated_clock(monkeypatch):
    from megatron_ext.bench import host_census

    monkeypatch.setattr(host_census, "time", types.SimpleNamespace(perf_counter=lambda: _clock[0]))


@pytest.fixture
def fake_module():
    module = types.ModuleType("census_fake")

    def helper():
        _busy(0.002)

    class Base:
        def inherited(self):
            _busy(0.001)

    class Node(Base):
        @staticmethod
        def backward():
            module.helper()  # looked up at call time, as package code does: wrapped, and inclusive
            _busy(0.001)

        def method(self):
            return 7

    module.helper, module.Base, module.Node = helper, Base, Node
    sys.modules["census_fake"] = module
    yield module
    del sys.modules["census_fake"]


def test_times_and_calls_per_step_and_restores_the_originals(fake_module):
    node = fake_module.Node()
    originals = (fake_module.helper, dict(vars(fake_module.Node)), dict(vars(fake_module.Base)))

    def step():
        fake_module.helper()
        fake_module.Node.backward()
        node.inherited()
        assert node.method() == 7  # wrapped methods still bind `self` and return the result

    targets = [("census_fake", "helper"), ("census_fake", "Node.backward"), ("census_fake", "Node.inherited"),
               ("census_fake", "Node.method"), ("census_fake", "Node.missing"), ("census_fake", "Gone.attr")]
    rows = {row["function"]: row for row in function_census(step, targets, iters=5, warmup=1)}
    assert rows["census_fake.helper"]["calls_per_step"] == 2  # once directly, once inside backward
    assert rows["census_fake.helper"]["us_per_step"] == pytest.approx(4000)
    assert rows["census_fake.Node.backward"]["us_per_step"] == pytest.approx(3000)  # inclusive of its helper call
    assert rows["census_fake.Node.inherited"]["us_per_step"] == pytest.approx(1000)
    assert rows["census_fake.Node.method"]["calls_per_step"] == 1
    assert "census_fake.Node.missing" not in rows and "census_fake.Gone.attr" not in rows
    assert list(rows)[0] == "census_fake.helper"  # costliest first
    assert (fake_module.helper, dict(vars(fake_module.Node)), dict(vars(fake_module.Base))) == originals
    assert isinstance(vars(fake_module.Node)["backward"], staticmethod)


def test_the_rowwise_targets_name_what_the_package_has():
    """A renamed function would silently drop out of the census; the torch and Megatron names too."""
    missing = [f"{module}.{path}" for module, path in ROWWISE_TARGETS if _resolve(module, path) is None]
    assert missing == []
