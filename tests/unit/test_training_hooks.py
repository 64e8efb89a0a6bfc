"""Per-iteration hooks inside megatron.training: metrics and replica checks act under any script."""

from types import SimpleNamespace

import torch

from megatron_ext import training_hooks
from megatron_ext.config import MoEExtConfig


class _LayerWithMetrics(torch.nn.Module):
    def __init__(self, dropped=3):
        super().__init__()
        self.reads, self.dropped = 0, dropped

    def read_metrics(self):
        self.reads += 1
        return {"dropped_routes": self.dropped, "mean_buffer_fill": 0.5, "capacity": 64}


def test_metrics_are_read_every_interval(capsys):
    model = torch.nn.Sequential(_LayerWithMetrics(), _LayerWithMetrics())
    config = MoEExtConfig(metrics_interval=2)
    for iteration in range(1, 6):
        training_hooks.after_train_step([model], iteration, config)
    assert [m.reads for m in model] == [2, 2], "iterations 2 and 4 read each layer once"
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [f"megatron_ext routing (rank 0, iterations up to {i}): dropped routes 6 | mean capacity fill "
                     f"0.500 | capacity 64 rows" for i in (2, 4)]


def test_dropped_routes_are_reported_at_logging_steps_without_metrics(capsys):
    """Megatron's layer with the same flags would be dropless: a capacity-bounded layer's drops are
    never silent (one read per logging step, summed over ranks, a warning only when there were any)."""
    model = torch.nn.Sequential(_LayerWithMetrics(), _LayerWithMetrics(dropped=4))
    for iteration in range(1, 11):
        training_hooks.after_train_step(model, iteration, MoEExtConfig(), log_interval=5)
    assert [m.reads for m in model] == [2, 2]
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[:2] for line in lines] == [["megatron_ext", " warning"]] * 2, lines
    assert "dropped 7 routes (all ranks) in the iterations up to 10" in lines[1]
    assert "--moe-ext-dropless-arena" in lines[1] and "--moe-ext-capacity-factor" in lines[1]
    arena = MoEExtConfig(dropless_arena=True, on_overflow="drop")  # the advice is not the arena it runs on
    training_hooks.after_train_step(model, 15, arena, log_interval=5)
    line = capsys.readouterr().out
    assert "their dropless arena holds" in line and "--moe-ext-on-overflow error" in line, line
    quiet = torch.nn.Sequential(_LayerWithMetrics(dropped=0))
    training_hooks.after_train_step(quiet, 5, MoEExtConfig(), log_interval=5)
    assert quiet[0].reads == 1 and capsys.readouterr().out == ""


def test_nothing_is_read_where_nothing_can_drop_or_metrics_report_drops(capsys):
    model = torch.nn.Sequential(_LayerWithMetrics())
    for config in (MoEExtConfig(dropless=True), MoEExtConfig(dispatcher="megatron")):
        training_hooks.after_train_step(model, 10, config)
    training_hooks.after_train_step(model, 3, MoEExtConfig(metrics_interval=4))
    assert model[0].reads == 0 and capsys.readouterr().out == ""


def test_hook_point_and_install_are_idempotent(monkeypatch):
    from megatron.training import training

    training_hooks.check_hook_point()  # megatron.training as shipped in the pinned wheel
    original = getattr(training.train_step, "__wrapped__", training.train_step)  # another test may have wrapped it
    monkeypatch.setattr(training, "train_step", original)
    assert not training_hooks.install(MoEExtConfig(dispatcher="megatron")), "Megatron's layers: nothing to install"
    assert training.train_step is original
    assert training_hooks.install(MoEExtConfig(metrics_interval=5))
    wrapped = training.train_step
    assert wrapped is not original and wrapped.__wrapped__ is original
    assert training_hooks.install(MoEExtConfig(replica_check_interval=3))
    assert training.train_step is wrapped and wrapped._megatron_ext_config[0].replica_check_interval == 3


def test_ddp_buckets_install_the_hook_under_megatrons_layers(monkeypatch):
    """--moe-ext-ddp-buckets wraps Megatron's DDP whatever builds the MoE layers: the hook installs
    for Megatron's dispatcher too."""
    from megatron.training import training

    original = getattr(training.train_step, "__wrapped__", training.train_step)
    monkeypatch.setattr(training, "train_step", original)
    assert training_hooks.install(MoEExtConfig(dispatcher="megatron", ddp_buckets=True))
    assert training.train_step.__wrapped__ is original and training.train_step._megatron_ext_config[0].ddp_buckets


def test_wrapped_train_step_runs_the_hooks_with_megatrons_arguments(monkeypatch):
    from megatron.training import training

    calls = []

    def fake_train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                        forward_backward_func, iteration=None, pg_collection=None, p2p_communicator=None):
        return "step result"

    monkeypatch.setattr(training, "train_step", fake_train_step)
    monkeypatch.setattr(training_hooks, "after_train_step",
                        lambda model, it, cfg, log_interval=1, last=False: calls.append((model, it, last)))
    monkeypatch.setattr(training_hooks, "_megatron_args", lambda: SimpleNamespace(log_interval=5, train_iters=10))
    training_hooks.install(MoEExtConfig(metrics_interval=1))
    assert training.train_step(None, None, "MODEL", None, None, None, None, iteration=7) == "step result"
    training.train_step(None, None, "MODEL", None, None, None, None, iteration=9)
    # train() (0.19.2) passes the iterations done before this one; Megatron logs this one as 8, then 10 (the last)
    assert calls == [("MODEL", 8, False), ("MODEL", 10, True)]


def test_megatrons_train_passes_the_iterations_done_and_counts_after_the_step():
    """The hook numbers a step iteration + 1 because train() (0.19.2) calls train_step(...,
    iteration=iteration) before `iteration += 1` and logs the incremented number; if that order
    changes, the reports and checks fall one step off Megatron's log."""
    import ast
    import inspect
    import textwrap

    from megatron.training import training

    train = getattr(training.train, "__wrapped__", training.train)
    tree = ast.parse(textwrap.dedent(inspect.getsource(train)))
    def passes_iteration(call):
        return any(k.arg == "iteration" and getattr(k.value, "id", None) == "iteration" for k in call.keywords)

    step_line = min(node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
                    and getattr(node.func, "id", None) == "train_step" and passes_iteration(node))
    increments = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.AugAssign)
                  and getattr(node.target, "id", None) == "iteration"]  # one more in the skipped-iteration branch
    assert any(line > step_line for line in increments), (step_line, increments)


def test_the_last_step_and_every_evaluation_check_for_overflow(monkeypatch):
    """Bounded dropless: an overflow in the iterations after the last logging step, or in an
    evaluation, is raised too (a review: 64 overflowed routes of step 9 of 10 went unchecked)."""
    from megatron.training import training

    checked = []

    def fake_train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                        forward_backward_func, iteration=None, pg_collection=None, p2p_communicator=None):
        return None

    def fake_evaluate(forward_step_func, data_iterator, model, process_non_loss_data_func, config, verbose=False):
        checked.append("evaluated")

    monkeypatch.setattr(training, "train_step", fake_train_step)
    monkeypatch.setattr(training, "evaluate", fake_evaluate)
    monkeypatch.setattr(training_hooks, "check_overflows", lambda model: checked.append(("check", model)))
    monkeypatch.setattr(training_hooks, "_megatron_args", lambda: SimpleNamespace(log_interval=5, train_iters=12))
    training_hooks.install(MoEExtConfig(on_overflow="error"))
    for done in range(12):
        training.train_step(None, None, "MODEL", None, None, None, None, iteration=done)
    training.evaluate(None, None, "MODEL", None, None)
    assert checked == [("check", "MODEL")] * 3 + ["evaluated", ("check", "MODEL")], checked  # 5, 10, 12, eval
    checked.clear()
    training_hooks.install(MoEExtConfig())  # on_overflow "auto" with capacity: drops reported, no check
    training.evaluate(None, None, "MODEL", None, None)
    assert checked == ["evaluated"]


def test_overflow_is_checked_every_log_interval():
    from megatron_ext.moe.overflow import CapacityExceeded

    class _Bounded(torch.nn.Module):
        checks = 0

        def check_overflow(self):
            type(self).checks += 1
            if type(self).checks == 2:
                raise CapacityExceeded("overflowed")

    model = torch.nn.Sequential(_Bounded())
    config = MoEExtConfig(on_overflow="error")
    training_hooks.after_train_step(model, 3, config, log_interval=5)  # not a logging step
    training_hooks.after_train_step(model, 5, config, log_interval=5)
    assert _Bounded.checks == 1
    import pytest

    with pytest.raises(CapacityExceeded):
        training_hooks.after_train_step(model, 10, config, log_interval=5)


def test_wrapped_train_step_attaches_the_dropless_arena_first(monkeypatch):
    from megatron.training import training

    from megatron_ext.moe import arena

    seen = []

    def fake_train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                        forward_backward_func, iteration=None, pg_collection=None, p2p_communicator=None):
        seen.append(("step", model))

    def fake_evaluate(forward_step_func, data_iterator, model, process_non_loss_data_func, config, verbose=False):
        seen.append(("evaluate", model))

    monkeypatch.setattr(training, "train_step", fake_train_step)
    monkeypatch.setattr(training, "evaluate", fake_evaluate)
    monkeypatch.setattr(arena, "attach_arenas", lambda model: seen.append(("attach", model)))
    monkeypatch.setattr(training_hooks, "after_train_step", lambda *args, **kwargs: None)
    monkeypatch.setattr(training_hooks, "check_overflows", lambda model: seen.append(("check", model)))
    assert training_hooks.install(MoEExtConfig(dropless_arena=True))
    training.train_step(None, None, ["CHUNK"], None, None, None, None, iteration=1)
    assert seen == [("attach", ["CHUNK"]), ("step", ["CHUNK"])]
    # --skip-train: Megatron evaluates a model no train_step has seen (evaluate_and_print_results
    # calls evaluate by its module-level name); the arena is attached there too
    seen.clear()
    training.evaluate(None, None, ["EVAL"], None, None)
    assert seen == [("attach", ["EVAL"]), ("evaluate", ["EVAL"]), ("check", ["EVAL"])]  # the arena's overflows
    assert training.evaluate.__wrapped__ is fake_evaluate


def test_ddp_buckets_refuse_a_chunk_that_is_not_megatrons_ddp():
    """Another script's FSDP (or no wrapper) reaches the hook: refused, naming the chunk and the fix."""
    import pytest

    with pytest.raises(TypeError, match="model chunk 0 is a Linear: drop --moe-ext-ddp-buckets"):
        training_hooks.install_ddp_buckets([torch.nn.Linear(2, 2)])


def test_ddp_buckets_install_once_per_chunk_and_say_so(monkeypatch, capsys):
    """Each chunk gets install_folding_ddp once (a later step finds its grad_launcher), a lone chunk
    as well as a list, and rank 0 prints each chunk's report once; a chunk that is not Megatron's
    DDP is named by its index."""
    import pytest
    from megatron.core.distributed import DistributedDataParallel

    from megatron_ext.ddp import megatron_hook

    class _DDP(DistributedDataParallel):
        def __init__(self):
            torch.nn.Module.__init__(self)  # isinstance is what the hook asks; no buffers needed

    installed = []

    def install_folding_ddp(chunk):
        installed.append(chunk)
        chunk.grad_launcher = object()
        return ["dense: already reduces over DP x CP", "expert: already reduces over EP_DP"]

    monkeypatch.setattr(megatron_hook, "install_folding_ddp", install_folding_ddp)
    chunks = [_DDP(), _DDP()]
    for _ in range(2):  # two train_steps
        training_hooks.install_ddp_buckets(chunks)
    assert installed == chunks  # nn.Module compares by identity
    assert capsys.readouterr().out.splitlines() == [
        f"megatron_ext: DDP buckets of model chunk {index} in one launch order; dense: already reduces over DP x CP; "
        f"expert: already reduces over EP_DP" for index in (0, 1)]
    lone = _DDP()
    training_hooks.install_ddp_buckets(lone)
    assert installed[-1] is lone and len(installed) == 3
    with pytest.raises(TypeError, match="model chunk 1 is a Linear: drop --moe-ext-ddp-buckets"):
        training_hooks.install_ddp_buckets([lone, torch.nn.Linear(2, 2)])


def test_the_replica_check_refuses_fsdp_chunks_from_any_script():
    """Other scripts than the launcher: an FSDP chunk holds shards, not replicas; refused before any collective."""
    import pytest
    from megatron.core.distributed import FullyShardedDataParallel, TorchFullyShardedDataParallel

    for wrapper in (FullyShardedDataParallel, TorchFullyShardedDataParallel):
        chunk = wrapper.__new__(wrapper)  # the type is what is checked; no process group needed
        torch.nn.Module.__init__(chunk)
        with pytest.raises(TypeError, match=f"--moe-ext-replica-check-interval with model chunk 1 wrapped in "
                                            f"{wrapper.__name__}: FSDP gives each data-parallel rank a different"):
            training_hooks.after_train_step([torch.nn.Linear(2, 2), chunk], 5, MoEExtConfig(replica_check_interval=5))
