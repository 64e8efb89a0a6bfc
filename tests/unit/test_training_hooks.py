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


class _LayerWithoutSteps(torch.nn.Module):
    """A layer with no forward since the last read: read_metrics returns None (moe/layer.py)."""

    def read_metrics(self):
        return None


class _LayerWithNonfinite(_LayerWithMetrics):
    def __init__(self, fill, nonfinite):
        super().__init__(dropped=1)
        self.fill, self.nonfinite = fill, nonfinite

    def read_metrics(self):
        return {"dropped_routes": 1, "mean_buffer_fill": self.fill, "capacity": 64,
                "nonfinite_prob_routes": self.nonfinite}


def test_metrics_line_averages_the_layers_that_reported_and_names_nonfinite_probabilities(capsys):
    """The mean fill is over the layers that read something: a layer with nothing to report (None)
    is not a zero fill; NaN/Inf router probabilities are summed over layers and named at the end."""
    model = torch.nn.Sequential(_LayerWithoutSteps(), _LayerWithNonfinite(0.25, 2), _LayerWithNonfinite(0.5, 3))
    training_hooks.after_train_step(model, 4, MoEExtConfig(metrics_interval=2))
    line = capsys.readouterr().out.strip()
    # fills 0.25 and 0.5 from the two layers that reported: (0.25 + 0.5) / 2 = 0.375 (not / 3 = 0.250)
    assert line == ("megatron_ext routing (rank 0, iterations up to 4): dropped routes 2 | mean capacity fill 0.375 | "
                    "capacity 64 rows | NaN/Inf router probabilities on 5 routes"), line
    quiet = torch.nn.Sequential(_LayerWithoutSteps(), _LayerWithMetrics())
    assert training_hooks.routing_metrics_line(quiet, 2).endswith("mean capacity fill 0.500 | capacity 64 rows")


def test_only_rank_0_prints_the_drop_report_and_the_metrics(monkeypatch, capsys):
    """Every rank computes the drop report (its all-reduce is a collective) but only rank 0 prints it;
    a world of N ranks would otherwise print the same warning N times."""
    monkeypatch.setattr(training_hooks.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(training_hooks.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(training_hooks, "_sum_over_ranks", lambda value: value)
    model = torch.nn.Sequential(_LayerWithMetrics())
    assert training_hooks.report_drops(model, 5, MoEExtConfig()) is not None  # rank 1 has the line, too
    training_hooks.after_train_step(model, 5, MoEExtConfig(), log_interval=5)
    training_hooks.after_train_step(model, 4, MoEExtConfig(metrics_interval=2))
    assert model[0].reads == 3 and capsys.readouterr().out == ""
    monkeypatch.setattr(training_hooks.dist, "get_rank", lambda: 0)  # the same on rank 0 prints
    training_hooks.after_train_step(model, 5, MoEExtConfig(), log_interval=5)
    assert "dropped 3 routes (all ranks)" in capsys.readouterr().out


def _fake_train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                     forward_backward_func, iteration=None, pg_collection=None, p2p_communicator=None):
    return "step result"


def test_the_replica_check_installs_the_hook_under_megatrons_layers(monkeypatch):
    """--moe-ext-replica-check-interval checks Megatron's own MoE layers' replicas too: the hook
    installs for Megatron's dispatcher, with that interval."""
    from megatron.training import training

    monkeypatch.setattr(training, "train_step", _fake_train_step)
    monkeypatch.setattr(training, "evaluate", getattr(training.evaluate, "__wrapped__", training.evaluate))
    assert training_hooks.install(MoEExtConfig(dispatcher="megatron", replica_check_interval=3))
    assert training.train_step.__wrapped__ is _fake_train_step
    assert training.train_step._megatron_ext_config[0].replica_check_interval == 3


def test_ddp_buckets_are_installed_by_the_step_before_megatrons_step(monkeypatch):
    """--moe-ext-ddp-buckets takes effect in the wrapped step, before Megatron's step syncs gradients;
    without it the flag would do nothing."""
    from megatron.training import training

    seen = []

    def fake_train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                        forward_backward_func, iteration=None, pg_collection=None, p2p_communicator=None):
        seen.append(("step", model))

    monkeypatch.setattr(training, "train_step", fake_train_step)
    monkeypatch.setattr(training, "evaluate", getattr(training.evaluate, "__wrapped__", training.evaluate))
    monkeypatch.setattr(training_hooks, "install_ddp_buckets", lambda model: seen.append(("ddp buckets", model)))
    monkeypatch.setattr(training_hooks, "after_train_step", lambda *args, **kwargs: None)
    monkeypatch.setattr(training_hooks, "_megatron_args", lambda: SimpleNamespace(log_interval=1, train_iters=10))
    assert training_hooks.install(MoEExtConfig(dispatcher="megatron", ddp_buckets=True))
    training.train_step(None, None, ["CHUNK"], None, None, None, None, iteration=0)
    assert seen == [("ddp buckets", ["CHUNK"]), ("step", ["CHUNK"])]


def test_a_step_without_iteration_counts_from_megatrons_curr_iteration(monkeypatch):
    """A caller that passes no iteration= (train() before 0.19.2, other scripts): the iterations done
    are Megatron's args.curr_iteration, so after 41 done this step is 42; with --exit-interval 42
    Megatron stops after it, so it is the last (its drops and overflows are reported)."""
    from megatron.training import training

    calls = []
    monkeypatch.setattr(training, "train_step", _fake_train_step)
    monkeypatch.setattr(training, "evaluate", getattr(training.evaluate, "__wrapped__", training.evaluate))
    monkeypatch.setattr(training_hooks, "after_train_step",
                        lambda model, it, cfg, log_interval=1, last=False: calls.append((model, it, last)))
    monkeypatch.setattr(training_hooks, "_megatron_args", lambda: SimpleNamespace(
        log_interval=5, train_iters=100, exit_interval=42, curr_iteration=41))
    training_hooks.install(MoEExtConfig(metrics_interval=1))
    assert training.train_step(None, None, "MODEL", None, None, None, None) == "step result"
    assert calls == [("MODEL", 42, True)]


def test_training_ends_at_train_iters_or_an_exit_interval_multiple():
    """Megatron stops after --train-iters, or after any multiple of --exit-interval before that."""
    args = SimpleNamespace(train_iters=100, exit_interval=20)
    assert [step for step in range(1, 101) if training_hooks._ends_training(args, step)] == [20, 40, 60, 80, 100]
    assert not training_hooks._ends_training(args, 41)
    assert training_hooks._ends_training(SimpleNamespace(train_iters=None, exit_interval=20), 40)
    assert not training_hooks._ends_training(SimpleNamespace(), 40)  # neither set: a run stopped otherwise


def test_reinstalling_wraps_megatrons_evaluate_once(monkeypatch):
    """A second install on a fresh train_step (the hooks installed again in one process) re-wraps
    Megatron's own evaluate, not the earlier wrap: one evaluation attaches the arena once."""
    from megatron.training import training

    from megatron_ext.moe import arena

    seen = []

    def fake_evaluate(forward_step_func, data_iterator, model, process_non_loss_data_func, config, verbose=False):
        seen.append("evaluate")

    monkeypatch.setattr(training, "evaluate", fake_evaluate)
    monkeypatch.setattr(arena, "attach_arenas", lambda model: seen.append("attach"))
    monkeypatch.setattr(training_hooks, "check_overflows", lambda model: seen.append("check"))
    for _ in range(2):
        monkeypatch.setattr(training, "train_step", _fake_train_step)  # fresh: install wraps it again
        assert training_hooks.install(MoEExtConfig(dropless_arena=True))
    training.evaluate(None, None, ["EVAL"], None, None)
    assert seen == ["attach", "evaluate", "check"]  # bounded dropless: the evaluation's overflows, once
    assert training.evaluate.__wrapped__ is fake_evaluate


def test_hook_point_check_fails_when_train_step_loses_its_iteration(monkeypatch):
    """The hook numbers steps from train_step's iteration argument: a train_step without it is a
    changed Megatron, refused loudly rather than numbering every step from curr_iteration."""
    import pytest
    from megatron.training import training

    from megatron_ext.rules import MegatronInternalsChanged

    def step(forward_step_func, data_iterator, model, optimizer):
        return None

    monkeypatch.setattr(training, "train_step", step)
    with pytest.raises(MegatronInternalsChanged, match=r"train_step\(forward_step_func, data_iterator, model, "
                                                       r"optimizer\) \(expected"):
        training_hooks.check_hook_point()
