"""MoEExtConfig validation: every bad setting is a clear error."""

import pytest

from megatron_ext.config import MoEExtConfig


@pytest.mark.parametrize("kwargs,match", [
    (dict(transport="nvlink"), "unknown row transport 'nvlink'"),
    (dict(dispatcher="flex"), "unknown MoE dispatcher"),
    (dict(capacity_factor=0.0), "capacity_factor must be > 0"),
    (dict(capacity_factor=-1.0), "capacity_factor must be > 0"),
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank must be >= 1"),
    (dict(metrics_interval=-1), "metrics_interval"),
    (dict(lease_slots=0), "lease_slots"),
    (dict(dispatcher="megatron", mxfp8_dispatch=True), "mxfp8_dispatch needs dispatcher='rowwise'"),
    (dict(dispatcher="megatron", cuda_graphs=True), "cuda_graphs"),
    (dict(dispatcher="megatron", on_overflow="drop"), "on_overflow applies to dispatcher='rowwise'"),
    (dict(cuda_graphs=True, debug_checks=True), "cuda_graphs with debug_checks"),
    (dict(return_transfer="push"), "unknown return_transfer 'push'"),
    (dict(router_gemms="cutlass"), "unknown router_gemms 'cutlass'; choose one of \\('triton', 'cublas'\\)"),
    (dict(return_transfer="put", transport="torch"), "mode of the symm transport; use return_transfer='get'"),
    (dict(return_transfer="put", transport="deepep"), "transport='deepep'"),
    (dict(return_transfer="put", dispatcher="megatron"), "dispatcher='megatron'"),
])
def test_bad_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEExtConfig(**kwargs)


def test_a_misspelt_setting_names_the_closest():
    with pytest.raises(TypeError, match=r"no setting 'capacity_fator' \(did you mean capacity_factor\?\)"):
        MoEExtConfig(capacity_fator=1.5)
    with pytest.raises(TypeError, match=r"no setting 'speed'; its settings: dispatcher, transport"):
        MoEExtConfig(speed=2)
    config = MoEExtConfig(capacity_factor=1.5)  # known names, positional or by keyword, still build
    assert MoEExtConfig("rowwise", "torch") == MoEExtConfig(transport="torch") and config.capacity_factor == 1.5


def test_defaults_are_valid():
    config = MoEExtConfig()
    assert (config.dispatcher, config.transport, config.capacity_factor) == ("rowwise", "auto", 1.25)
    assert "capacity_factor" in MoEExtConfig.field_names()


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(dispatcher="megatron", transport="symm"), ValueError, "only applies to dispatcher='rowwise'"),
    (dict(capacity_factor=float("inf")), ValueError, "finite"),
    (dict(capacity_factor=float("nan")), ValueError, "finite"),
    (dict(capacity_factor="1.25"), TypeError, "capacity_factor must be a number"),
    (dict(capacity_factor=True), TypeError, "capacity_factor must be a number"),
    (dict(lease_slots=1.5), TypeError, "lease_slots must be an integer"),
    (dict(max_tokens_per_rank=2.5), TypeError, "max_tokens_per_rank must be an integer"),
    (dict(dropless="no"), TypeError, "dropless must be True or False"),
    (dict(metrics_interval=True), TypeError, "metrics_interval must be an integer"),
])
def test_python_api_refuses_what_the_launcher_refuses(kwargs, error, match):
    with pytest.raises(error, match=match):
        MoEExtConfig(**kwargs)


def test_integer_capacity_factor_is_a_number():
    assert MoEExtConfig(capacity_factor=2).capacity_factor == 2


def test_every_config_field_has_a_consumer():
    """Each MoEExtConfig field is read somewhere outside config.py/arguments.py (no dead settings)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "megatron_ext"
    sources = "\n".join(p.read_text() for p in root.rglob("*.py") if p.name not in ("config.py", "arguments.py"))
    unread = [name for name in MoEExtConfig.field_names() if not re.search(rf"\.{name}\b", sources)]
    assert not unread, f"MoEExtConfig fields nothing reads: {unread}"


def test_megatron_cuda_graph_runners_whole_layers_only_for_the_rowwise_layer():
    """One rule for the launcher and the layer (a TransformerConfig has the same field names):
    Megatron's local runner capturing whole layers without pipeline parallelism is accepted, the
    other modes are refused naming --moe-ext-cuda-graphs, and both runners at once are refused."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import CudaGraphModule

    from megatron_ext.rules import graph_runner_clash, rowwise_problems

    for accepted in (SimpleNamespace(cuda_graph_impl="local", cuda_graph_modules=[]),
                     SimpleNamespace(cuda_graph_impl="none", enable_cuda_graph=True),
                     SimpleNamespace(cuda_graph_impl="local", cuda_graph_modules="full",
                                     pipeline_model_parallel_size=1),
                     SimpleNamespace(cuda_graph_impl="none")):
        assert rowwise_problems(accepted) == [], accepted
    for settings, flag in (
            (SimpleNamespace(cuda_graph_impl="transformer_engine"), "--cuda-graph-impl transformer_engine"),
            (SimpleNamespace(cuda_graph_impl="none", external_cuda_graph=True), "--external-cuda-graph"),
            (SimpleNamespace(cuda_graph_impl="local", cuda_graph_modules=[CudaGraphModule.moe_router]),
             "--cuda-graph-impl local with --cuda-graph-modules"),
            (SimpleNamespace(cuda_graph_impl="local", cuda_graph_modules=[], pipeline_model_parallel_size=2),
             "--cuda-graph-impl local with --pipeline-model-parallel-size 2")):
        problems = rowwise_problems(settings)
        assert len(problems) == 1 and problems[0].startswith(flag) and "--moe-ext-cuda-graphs" in problems[0]
    local = SimpleNamespace(cuda_graph_impl="local", cuda_graph_modules=[], expert_model_parallel_size=2)
    assert graph_runner_clash(local, MoEExtConfig(transport="symm")) == []
    assert graph_runner_clash(SimpleNamespace(cuda_graph_impl="none"), MoEExtConfig(cuda_graphs=True)) == []
    for ext, words in ((MoEExtConfig(cuda_graphs=True), "twice"), (MoEExtConfig(debug_checks=True), "host"),
                       (MoEExtConfig(transport="torch"), "NCCL")):
        problems = graph_runner_clash(local, ext)
        assert len(problems) == 1 and words in problems[0], problems


@pytest.mark.parametrize("settings,words", [
    (dict(tensor_model_parallel_size=2, moe_router_load_balancing_type=["aux_loss"], moe_aux_loss_coeff=[1e-2]),
     "aux_loss at tensor x context parallel size 2"),
    (dict(context_parallel_size=2, moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3),
     "seq_aux_loss at tensor x context parallel size 2"),
    (dict(tensor_model_parallel_size=2, moe_router_load_balancing_type=["quantile_balancing"]),
     "quantile_balancing at tensor x context parallel size 2"),
    (dict(moe_enable_routing_replay=True), "--moe-enable-routing-replay"),
    (dict(tensor_model_parallel_size=2, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0), None),
    (dict(tensor_model_parallel_size=1, moe_router_load_balancing_type=["aux_loss"], moe_aux_loss_coeff=[1e-2]), None),
    (dict(tensor_model_parallel_size=2, moe_router_load_balancing_type=["none"]), None)])
def test_graph_runner_refuses_routers_it_could_never_capture(settings, words):
    """What cuda_graphs/blockers.capture_blockers would find at every capture (NCCL or host lists in
    Megatron's router): refused at start-up, not a graphed run whose layers all stay eager."""
    from types import SimpleNamespace

    from megatron_ext.rules import graph_runner_clash

    problems = graph_runner_clash(SimpleNamespace(**settings), MoEExtConfig(cuda_graphs=True))
    assert graph_runner_clash(SimpleNamespace(**settings), MoEExtConfig()) == []  # eager layers: nothing to refuse
    if words is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith("--moe-ext-cuda-graphs with --") and words in problems[0]


def test_put_return_refused_where_auto_resolves_to_torch():
    """transport='auto' is only known at layer build: on CPU it is the torch transport."""
    import torch

    from megatron_ext.moe.transport import make_transport

    with pytest.raises(ValueError, match="resolved to 'torch' here"):
        make_transport(MoEExtConfig(return_transfer="put"), None, 16, torch.device("cpu"))


def test_overflow_policy_auto_is_error_with_the_arena_and_drop_otherwise():
    assert MoEExtConfig().on_overflow == "auto" and MoEExtConfig().overflow_policy == "drop"
    assert MoEExtConfig(dropless_arena=True).overflow_policy == "error"  # a dropless mode never drops silently
    assert MoEExtConfig(dropless_arena=True, on_overflow="drop").overflow_policy == "drop"
    assert MoEExtConfig(on_overflow="error").overflow_policy == "error"
    assert MoEExtConfig(dropless=True).overflow_policy == "drop"  # worst-case buffers: nothing to overflow


@pytest.mark.parametrize("field,value", [
    ("capacity_factor", 2.0), ("dropless", True), ("max_tokens_per_rank", 64), ("lease_slots", 2),
    ("fused_router", False), ("peer_timeout_s", 5.0), ("metrics_interval", 10), ("debug_poison", True),
    ("arena_region_factor", 0.5), ("router_gemms", "cublas")])
def test_rowwise_settings_are_refused_not_ignored_under_megatrons_dispatcher(field, value):
    MoEExtConfig(**{field: value}, **({"dropless_arena": True} if field == "arena_region_factor" else {}))  # rowwise
    with pytest.raises(ValueError, match=rf"^{field} only applies to dispatcher='rowwise'.*leave it at its default"):
        MoEExtConfig(dispatcher="megatron", **{field: value})


def test_several_rowwise_settings_under_megatrons_dispatcher_are_named_together():
    with pytest.raises(ValueError, match=r"^capacity_factor, lease_slots only apply to dispatcher='rowwise'.*leave "
                                         r"them at their defaults"):
        MoEExtConfig(dispatcher="megatron", capacity_factor=2.0, lease_slots=2)



def test_a_setting_passed_at_its_default_value_is_not_a_change():
    """Equal to the default is unchanged, also for a float object of its own (as a command line parses
    it): dispatcher='megatron' accepts capacity_factor=1.25 and arena_region_factor=1.0 spelt out."""
    config = MoEExtConfig(dispatcher="megatron", capacity_factor=float("1.25"), arena_region_factor=float("1.0"))
    assert config.changed_fields() == ["dispatcher"]
    assert MoEExtConfig(dropless=True, capacity_factor=float("1.25")).changed_fields() == ["dropless"]

@pytest.mark.parametrize("value", [-1.0, 0.0, float("nan"), float("inf")])
def test_arena_region_factor_is_checked_without_the_arena_too(value):
    with pytest.raises(ValueError, match="arena_region_factor must be > 0 and finite"):
        MoEExtConfig(arena_region_factor=value)


@pytest.mark.parametrize("settings,field", [
    (dict(dropless=True, capacity_factor=2.0), "capacity_factor"),
    (dict(dropless=True, on_overflow="drop"), "on_overflow"),
    (dict(arena_region_factor=0.5), "arena_region_factor"),
    (dict(fused_router=False, router_gemms="cublas"), "router_gemms"),
    (dict(fused_route_map=False, router_gemms="cublas"), "router_gemms"),
    (dict(transport="torch", lease_slots=2), "lease_slots"),
    (dict(transport="deepep", lease_slots=2), "lease_slots"),
    (dict(transport="deepep", peer_timeout_s=5.0), "peer_timeout_s"),
    (dict(transport="torch", peer_timeout_s=5.0), "peer_timeout_s")])
def test_a_rowwise_setting_another_one_disables_is_refused(settings, field):
    with pytest.raises(ValueError, match=rf"{field}=.* does nothing here: .*leave it at its default"):
        MoEExtConfig(**settings)
    MoEExtConfig(**{k: v for k, v in settings.items() if k != field})  # the rest alone is fine


@pytest.mark.parametrize("settings", [dict(transport="torch", dropless_arena=True, lease_slots=4),
                                      dict(transport="torch", cuda_graphs=True, lease_slots=4),
                                      dict(transport="symm", lease_slots=4)])
def test_lease_slots_are_kept_where_they_size_something(settings):
    """The arena's slots and the graph slots follow lease_slots on any transport."""
    assert MoEExtConfig(**settings).lease_slots == 4


def test_every_problem_is_reported_at_once():
    """Three unrelated mistakes: one error lists all three, so a user fixes them in one go."""
    with pytest.raises(ValueError) as error:
        MoEExtConfig(transport="nvlink", capacity_factor=0.0, lease_slots=0)
    message = str(error.value)
    assert message.startswith("3 problems in the MoE settings:")
    for part in ("unknown row transport 'nvlink'", "capacity_factor must be > 0", "lease_slots must be >= 1"):
        assert message.count(part) == 1, (part, message)


def test_wrong_types_are_reported_together_before_values():
    with pytest.raises(TypeError) as error:
        MoEExtConfig(dropless="yes", lease_slots=1.5, capacity_factor=-1.0)
    message = str(error.value)
    assert message.startswith("2 problems in the MoE settings:")
    assert "dropless must be True or False, got 'yes' (str)" in message
    assert "lease_slots must be an integer, got 1.5 (float)" in message
    assert "capacity_factor" not in message  # values are judged once their types are right


def test_an_infinite_region_factor_is_reported_once():
    with pytest.raises(ValueError) as error:
        MoEExtConfig(dropless_arena=True, arena_region_factor=float("inf"))
    assert str(error.value) == "arena_region_factor must be > 0 and finite, got inf"
