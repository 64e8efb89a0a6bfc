"""One set of rules: what megatron_ext needs from Megatron's settings, read by every door.

The launcher (`argument_checks.validate_against_megatron`, on parsed args), the rowwise layer
(`moe/layer.py`, on a TransformerConfig) and the experts (`moe/experts.py`) all ask this module,
so the Python API and the command line refuse the same things with the same reasons. Each
message names the TransformerConfig field and the flag that sets it.

Also the one statement of the Megatron release every internal hook was written against, and the
one error raised when such an internal changed.
"""

from __future__ import annotations

from dataclasses import dataclass

MEGATRON_VERSION = "0.19.2"


class MegatronInternalsChanged(RuntimeError):
    """A Megatron name or signature megatron_ext hooks is not what it was in MEGATRON_VERSION."""


@dataclass(frozen=True)
class Refused:
    """A Megatron option the rowwise dispatcher cannot run with (any value but the neutral ones)."""

    field: str  # TransformerConfig field, also the args dest
    flag: str
    why: str
    fix: str


ROWWISE_REFUSED: tuple[Refused, ...] = (
    Refused("moe_expert_capacity_factor", "--moe-expert-capacity-factor",
            "Megatron's per-expert capacity drops tokens on its host path",
            "use --moe-ext-capacity-factor (MoEExtConfig.capacity_factor, per destination rank) instead"),
    Refused("moe_pad_expert_input_to_capacity", "--moe-pad-expert-input-to-capacity",
            "padding to capacity happens in Megatron's dispatcher (the rowwise buffers are static already)",
            "drop it"),
    Refused("moe_shared_expert_overlap", "--moe-shared-expert-overlap",
            "the overlap lives inside Megatron's dispatcher (shared experts still run without it)", "drop it"),
    Refused("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm",
            "it is built for Megatron's alltoall/flex dispatchers", "drop it"),
    Refused("moe_latent_size", "--moe-latent-size", "it needs Transformer Engine latent projections", "drop it"),
    Refused("moe_enable_deepep", "--moe-enable-deepep", "it selects Megatron's flex dispatcher",
            "for DeepEP use --moe-ext-transport deepep"),
    Refused("moe_pad_experts_for_cuda_graph_inference", "--moe-pad-experts-for-cuda-graph-inference",
            "Megatron's inference engine then sets a per-expert capacity and padding on the live config, and its "
            "router hands every token more than top-k experts, which the rowwise routes cannot hold (their buffers "
            "are static already)", "drop it"),
)


# The experts' activation recompute, spelled in full: Megatron 0.19.2 honors moe_act only with selective
# granularity, and its TransformerConfig refuses it without --moe-grouped-gemm.
MOE_ACT_RECOMPUTE = "--recompute-granularity selective --recompute-modules moe_act --moe-grouped-gemm"

# What the grouped experts (DeviceOffsetGroupedMLP) cannot honor; under dispatcher="megatron" the
# layer builds Megatron's own experts instead (specs.moe_builder).
EXPERT_REFUSED: tuple[Refused, ...] = (
    Refused("fp8", "--fp8-format", "the grouped experts run their GEMMs in the parameters' dtype, not Transformer "
            "Engine's FP8 (megatron_ext's FP8 is --moe-ext-mxfp8-dispatch, for the dispatched rows)",
            "drop it, or use --moe-ext-dispatcher megatron"),
    Refused("fp4", "--fp4-format", "the grouped experts run their GEMMs in the parameters' dtype, not FP4",
            "drop it, or use --moe-ext-dispatcher megatron"),
    Refused("activation_func_fp8_input_store", "activation_func_fp8_input_store (TransformerConfig)",
            "the grouped experts keep the activation's input in the parameters' dtype",
            f"set it False, or save that memory with {MOE_ACT_RECOMPUTE}"),
    Refused("overlap_dispatch_backward_with_experts_wgrad", "--overlap-dispatch-backward-with-experts-wgrad",
            "the grouped experts compute their weight gradients in the main backward", "drop it"),
    Refused("moe_ncclep_zero_copy", "--moe-ncclep-zero-copy",
            "the grouped experts write fresh output tensors, not NCCL-EP's buffers", "drop it"),
    Refused("moe_paged_stash", "--moe-paged-stash", "the grouped experts do not stash their activations in pages",
            "drop it"),
)


def _is_set(value) -> bool:
    return value not in (None, False, 0)


def _spelled(flag: str, value) -> str:
    return flag if value is True else f"{flag} {value}"


def _as_list(modules) -> list:
    return list(modules) if isinstance(modules, (list, tuple)) else [modules]


def _whole_layer(modules) -> bool:
    """Megatron's cuda_graph_modules asking for the whole transformer layer (its default)."""
    if modules is None or modules == "full":
        return True
    return all(getattr(m, "value", m) == "full" for m in _as_list(modules))


def _graph_modules(settings) -> tuple[str, object]:
    """(the flag the user gave, its modules): --cuda-graph-modules, or the deprecated --cuda-graph-scope
    (the launcher's dest for it, or Megatron's config field)."""
    for flag, field in (("--cuda-graph-modules", "cuda_graph_modules"),
                        ("--cuda-graph-scope", "cuda_graph_scope_deprecated"),
                        ("--cuda-graph-scope", "cuda_graph_scope")):
        if getattr(settings, field, None):
            return flag, getattr(settings, field)
    return "--cuda-graph-modules", None


def _megatron_graph_flag(settings) -> str | None:
    graph_impl = getattr(settings, "cuda_graph_impl", None)
    return next((flag for flag, on in (
        (f"--cuda-graph-impl {graph_impl}", graph_impl not in (None, "none")),
        ("--enable-cuda-graph", bool(getattr(settings, "enable_cuda_graph", False))),
        ("--external-cuda-graph", bool(getattr(settings, "external_cuda_graph", False)))) if on), None)


def _layer_recompute(settings) -> tuple[str, str] | None:
    """Megatron's recompute of whole MoE layers (selective `moe`, or the deprecated
    --moe-layer-recompute that the TransformerConfig turns into it) or of whole transformer layers
    (full), as (flag, why the graph runner cannot serve it)."""
    granularity = getattr(settings, "recompute_granularity", None)
    if granularity == "full":
        return ("--recompute-granularity full", "the graph runner has not been run inside Megatron's full-layer "
                "recompute, which would replay the layer's graphs during the backward")
    modules = getattr(settings, "recompute_modules", None) or ()
    for flag, on in (("--recompute-modules moe", granularity == "selective" and "moe" in modules),
                     ("--moe-layer-recompute", bool(getattr(settings, "moe_layer_recompute", False)))):
        if on:
            return flag, ("the graph runner replays the MoE layer without Megatron's checkpoint around it, so the "
                          "layer would not be recomputed")
    return None


def graph_runner_clash(settings, ext) -> list[str]:
    """megatron_ext settings (an MoEExtConfig or the launcher's args, read by field name) against
    Megatron settings they cannot run with: layer recompute with megatron_ext's graph runner, and
    Megatron's own CUDA-graph runner against what it cannot capture."""
    def ext_value(field):
        return getattr(ext, field, getattr(ext, f"moe_ext_{field}", None))

    problems = []
    recompute = _layer_recompute(settings)
    if ext_value("cuda_graphs") and recompute:
        problems.append(f"{recompute[0]} with --moe-ext-cuda-graphs: {recompute[1]}; drop one "
                        f"({MOE_ACT_RECOMPUTE} works with the graph runner)")
    if ext_value("dropless_arena") and recompute:
        problems.append(f"{recompute[0]} with --moe-ext-dropless-arena: the recomputed layers would run out of "
                        f"their model order, which the arena's regions follow; drop one ({MOE_ACT_RECOMPUTE} "
                        f"recomputes inside each layer and works with the arena)")
    graph_flag = _megatron_graph_flag(settings)
    if ext_value("dropless_arena") and graph_flag:
        problems.append(f"{graph_flag} with --moe-ext-dropless-arena: Megatron's CUDA graphs are not built for the "
                        f"arena yet; drop one (--moe-ext-cuda-graphs captures the MoE layer with the arena)")
    if ext_value("cuda_graphs"):
        problems += _nccl_in_graph("--moe-ext-cuda-graphs", settings, ext_value("transport"))
        problems += [f"--moe-ext-cuda-graphs with {why}" for why in _router_blocks_capture(settings)]
    if not graph_flag:
        return problems
    if ext_value("cuda_graphs"):
        problems.append(f"{graph_flag} with --moe-ext-cuda-graphs: the two would capture the MoE layer twice; "
                        f"keep one")
    if ext_value("debug_checks"):
        problems.append(f"{graph_flag} with --moe-ext-debug-checks: the checks read device values on the host, "
                        f"which a CUDA-graph capture cannot contain; drop one")
    return problems + _nccl_in_graph(graph_flag, settings, ext_value("transport"))


def _nccl_in_graph(graph_flag: str, settings, transport: str) -> list[str]:
    """A graph of the MoE layer with a transport that runs NCCL inside it, at EP > 1."""
    ep = getattr(settings, "expert_model_parallel_size", 1) or 1
    if ep > 1 and transport in ("torch", "deepep"):
        return [f"{graph_flag} with --moe-ext-transport {transport} at --expert-model-parallel-size {ep}: that "
                f"transport runs NCCL collectives inside the layer, and a graph holding them keeps "
                f"destroy_process_group from returning; use --moe-ext-transport symm"]
    return []


def _balancing_coeffs(settings) -> dict[str, float]:
    """Megatron's load-balancing types and their loss coefficients (a flag's one value or list,
    a TransformerConfig's str / float or lists)."""
    kinds = getattr(settings, "moe_router_load_balancing_type", None) or []
    coeffs = getattr(settings, "moe_aux_loss_coeff", 0.0) or 0.0
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(kinds)
    return dict(zip(kinds, coeffs))


def _router_blocks_capture(settings) -> list[str]:
    """What in Megatron's router keeps the graph runner from ever capturing the layer, known from the
    settings (cuda_graphs/blockers.capture_blockers finds the same at run time, where the layer then
    stays eager): refused at start-up instead of a graphed run that is not. The global aux loss's
    group (TP x DP x CP) is left to run time: the data-parallel size is not a setting."""
    tp = getattr(settings, "tensor_model_parallel_size", 1) or 1
    tp_cp = tp * (getattr(settings, "context_parallel_size", 1) or 1)
    coeffs = _balancing_coeffs(settings)
    nccl = ("(NCCL inside the layer, and a graph holding NCCL work keeps destroy_process_group from returning); "
            "drop one")
    reasons = []
    if getattr(settings, "moe_enable_routing_replay", False):
        reasons.append("--moe-enable-routing-replay: router replay feeds the top-k from host-side lists that change "
                       "every step, which a graph would replay as captured; drop one")
    summed = [kind for kind in ("aux_loss", "seq_aux_loss") if coeffs.get(kind, 0.0) > 0]
    if summed and tp_cp > 1:
        reasons.append(f"--moe-router-load-balancing-type {summed[0]} at tensor x context parallel size {tp_cp}: the "
                       f"router all-reduces its counts over TP x CP {nccl}, or set --moe-aux-loss-coeff 0")
    if "quantile_balancing" in coeffs and tp_cp > 1:
        reasons.append(f"--moe-router-load-balancing-type quantile_balancing at tensor x context parallel size "
                       f"{tp_cp}: the router all-gathers its logits over TP x CP {nccl}")
    return reasons


def megatron_graph_problems(settings) -> list[str]:
    """Megatron's own CUDA-graph runners with the rowwise layer: `--cuda-graph-impl local` capturing
    whole transformer layers (attention and the MoE layer in one graph) with one live microbatch
    per layer (no pipeline parallelism) is accepted: measured on one H200 (EP 1, loss bitwise equal
    to eager, BENCHMARKS.md); the other modes have not been run and are refused."""
    graph_impl = getattr(settings, "cuda_graph_impl", None)
    graph_flag = _megatron_graph_flag(settings)
    if not graph_flag:
        return []
    instead = ("use --moe-ext-cuda-graphs (MoEExtConfig.cuda_graphs), which captures the rowwise MoE layer, "
               "forward and backward, for every capacity policy and pipeline schedule")
    local = graph_impl == "local" or bool(getattr(settings, "enable_cuda_graph", False))
    if not local:
        # --external-cuda-graph reads "none" until Megatron's validate_args sets transformer_engine
        runner = graph_impl if graph_impl not in (None, "none") else "transformer_engine"
        return [f"{graph_flag}: Megatron's {runner} CUDA-graph runner is not verified with the "
                f"rowwise layer; use --cuda-graph-impl local (whole layers), or {instead}"]
    modules_flag, modules = _graph_modules(settings)
    if not _whole_layer(modules):
        names = " ".join(getattr(m, "name", str(m)) for m in _as_list(modules))
        return [f"{graph_flag} with {modules_flag} {names}: Megatron's partial-layer MoE captures assume "
                f"its own dispatchers; leave {modules_flag} out (whole layers), or {instead}"]
    pipeline = getattr(settings, "pipeline_model_parallel_size", 1) or 1
    if pipeline > 1:
        return [f"{graph_flag} with --pipeline-model-parallel-size {pipeline}: a whole-layer graph bakes in one "
                f"dispatch-buffer slot, and pipeline schedules keep several microbatches of a layer alive; "
                f"{instead} (its slots follow the schedule)"]
    return []


def _refusals(settings, rules: tuple[Refused, ...]) -> list[str]:
    return [f"{rule.field}={getattr(settings, rule.field)!r} ({_spelled(rule.flag, getattr(settings, rule.field))}): "
            f"{rule.why}; {rule.fix}" for rule in rules if _is_set(getattr(settings, rule.field, None))]


def changed_after_build(config) -> str | None:
    """A refused setting switched on in a built layer's live TransformerConfig (Megatron's
    inference engine does this for decode padding): checked at each forward, host attributes only."""
    problems = _refusals(config, ROWWISE_REFUSED)
    if not problems:
        return None
    return ("the rowwise MoE layer's TransformerConfig changed after the layer was built, to settings it cannot "
            "run with:\n  - " + "\n  - ".join(problems))


def rowwise_problems(settings) -> list[str]:
    """Why the rowwise dispatcher cannot run with `settings` (a TransformerConfig or Megatron's args)."""
    problems = _refusals(settings, ROWWISE_REFUSED) + megatron_graph_problems(settings)
    if getattr(settings, "transformer_impl", None) == "inference_optimized":
        problems.append("transformer_impl='inference_optimized' (--transformer-impl inference_optimized): Megatron's "
                        "MoE layer swaps its own dispatcher back in for inference; use --transformer-impl local or "
                        "transformer_engine")
    if getattr(settings, "moe_token_dispatcher_type", None) == "flex":
        problems.append("moe_token_dispatcher_type='flex' (--moe-token-dispatcher-type flex): Megatron would build "
                        "its flex (DeepEP/HybridEP) dispatcher first; use alltoall (ignored by the rowwise layer) "
                        "and --moe-ext-transport deepep for DeepEP")
    etp = getattr(settings, "expert_tensor_parallel_size", None)
    tp = getattr(settings, "tensor_model_parallel_size", 1) or 1
    if etp is None and tp > 1:  # an explicit etp > 1 is the experts' problem (expert_problems)
        problems.append(f"tensor_model_parallel_size={tp} (--tensor-model-parallel-size {tp}) "
                        f"needs expert_tensor_parallel_size=1 (--expert-tensor-parallel-size 1): "
                        f"Megatron defaults it to the tensor-parallel size")
    return problems


@dataclass(frozen=True)
class ExpertSettings:
    """What the grouped experts depend on, read from a TransformerConfig or from Megatron's args.

    Activation, biases, dtype and sizes are not here: the grouped experts serve every activation,
    bias and size Megatron's experts do (docs/design.md, "Experts")."""

    gated: bool
    etp: int
    num_experts: int | None
    ep: int
    topk: int | None
    probs_on_input: bool
    glu_interleave: int | None = None
    recompute_activation: bool = False  # --recompute-granularity selective --recompute-modules moe_act
    offloaded: tuple[str, ...] = ()  # --offload-modules the experts would have to offload
    refused: tuple[str, ...] = ()  # EXPERT_REFUSED settings that are set, as messages

    @staticmethod
    def from_config(config) -> "ExpertSettings":
        return ExpertSettings(
            gated=bool(config.gated_linear_unit), etp=config.expert_tensor_parallel_size or 1,
            num_experts=config.num_moe_experts, ep=config.expert_model_parallel_size or 1,
            topk=config.moe_router_topk, probs_on_input=bool(config.moe_apply_probs_on_input),
            glu_interleave=getattr(config, "moe_mlp_glu_interleave_size", None),
            recompute_activation=_recomputes_activation(config), offloaded=_expert_offloads(config),
            refused=tuple(_refusals(config, EXPERT_REFUSED) + _cpu_offloading(config)))

    @staticmethod
    def from_args(args) -> "ExpertSettings":
        etp = getattr(args, "expert_tensor_parallel_size", None)
        gated = any(getattr(args, name, False) for name in ("swiglu", "quick_geglu", "gated_linear_unit"))
        return ExpertSettings(
            gated=gated, etp=1 if etp is None else etp, num_experts=getattr(args, "num_experts", None),
            ep=getattr(args, "expert_model_parallel_size", 1) or 1, topk=getattr(args, "moe_router_topk", None),
            probs_on_input=bool(getattr(args, "moe_apply_probs_on_input", False)),
            glu_interleave=getattr(args, "moe_mlp_glu_interleave_size", None),
            recompute_activation=_recomputes_activation(args), offloaded=_expert_offloads(args),
            refused=tuple(_refusals(args, EXPERT_REFUSED) + _cpu_offloading(args)))


# Megatron 0.19.2's optimizers that treat a parameter by its number of dimensions: every
# --optimizer but adam and sgd takes the emerging-optimizer path (optimizer/__init__.py), whose
# default rule sends each parameter that is not 2-D to Adam (emerging_optimizers.py,
# `_is_nonlinear_or_embedding`; Muon's kinds to --muon-scalar-optimizer). The grouped experts'
# weights are 3-D ([L, out, in]), so under these they would train with Adam, silently.
NDIM_ROUTED_OPTIMIZERS = ("muon", "dist_muon", "adaptive_muon", "soap", "lion")


def optimizer_problems(args) -> list[str]:
    """The launcher's --optimizer against the grouped experts' stacked weights (both dispatchers
    build them: Megatron's experts are only a fallback for a TransformerConfig they cannot serve)."""
    optimizer = getattr(args, "optimizer", None)
    if optimizer not in NDIM_ROUTED_OPTIMIZERS:
        return []
    return [f"--optimizer {optimizer}: Megatron applies {optimizer} only to 2-D parameters and gives the others to "
            f"Adam (Muon: to --muon-scalar-optimizer); megatron_ext's grouped experts store their weights as one 3-D "
            f"tensor per layer ([experts, out, in]), so they would not train with {optimizer}, without a message. "
            f"Use --optimizer adam or sgd, or run Megatron without megatron_ext for {optimizer}"]


EXPERT_OFFLOAD_MODULES = ("expert_fc1", "moe_act", "fused_group_mlp")  # Megatron 0.19.2's experts' offloads


def _recomputes_activation(settings) -> bool:
    """Megatron's selective recompute of the MoE activation (TransformerConfig or args, same names)."""
    return getattr(settings, "recompute_granularity", None) == "selective" \
        and "moe_act" in (getattr(settings, "recompute_modules", None) or ())


def _cpu_offloading(settings) -> list[str]:
    """Transformer Engine's CPU offloading: `cpu_offloading` on a TransformerConfig; on Megatron's
    args, before its validate_args sets that, `--cpu-offloading-num-layers`."""
    layers = getattr(settings, "cpu_offloading_num_layers", 0) or 0
    if not (getattr(settings, "cpu_offloading", False) or layers > 0):
        return []
    return [f"cpu_offloading (--cpu-offloading-num-layers {layers}): Transformer Engine's offload context does not "
            f"reach the tensors the grouped experts keep for their backward; drop it, or save the experts' "
            f"activation memory with {MOE_ACT_RECOMPUTE}"]


def _expert_offloads(settings) -> tuple[str, ...]:
    """The experts' activations Megatron's fine-grained activation offloading is asked to move."""
    if not getattr(settings, "fine_grained_activation_offloading", False):
        return ()
    return tuple(m for m in (getattr(settings, "offload_modules", None) or ()) if m in EXPERT_OFFLOAD_MODULES)


def moe_problems(settings: ExpertSettings) -> list[str]:
    """MoE settings no experts can run with (Megatron refuses them too): refused by every door."""
    problems = []
    if settings.probs_on_input and settings.topk != 1:
        problems.append(f"moe_apply_probs_on_input (--moe-apply-probs-on-input) needs moe_router_topk=1 "
                        f"(--moe-router-topk 1), as in Megatron; got moe_router_topk={settings.topk}")
    if settings.num_experts is not None:
        if settings.num_experts % settings.ep:
            problems.append(f"num_moe_experts={settings.num_experts} (--num-experts {settings.num_experts}) is not "
                            f"divisible by the expert-parallel size (--expert-model-parallel-size {settings.ep}): "
                            f"every expert-parallel rank holds the same number of experts")
        if settings.topk is not None and settings.topk < 1:
            problems.append(f"moe_router_topk={settings.topk} (--moe-router-topk {settings.topk}): every token needs "
                            f"at least one expert; choose top-k >= 1")
        if settings.topk is not None and settings.topk > settings.num_experts:
            problems.append(f"moe_router_topk={settings.topk} (--moe-router-topk {settings.topk}) exceeds "
                            f"num_moe_experts={settings.num_experts} (--num-experts {settings.num_experts}); choose "
                            f"top-k <= the number of experts")
    return problems


# Why grouped experts cannot keep their rows in a dropless arena (moe/experts.arena_problems, the launcher).
ARENA_NEEDS_FAST_PATH = ("the dropless arena runs SwiGLU experts without biases whose sizes are multiples of 16 "
                         "bytes (the grouped experts' fast path): use --swiglu --disable-bias-linear, or drop "
                         "--moe-ext-dropless-arena")
ARENA_PROBS_ON_INPUT = ("moe_apply_probs_on_input (--moe-apply-probs-on-input) scales a copy of the rows, which the "
                        "dropless arena does not hold: drop one of it and --moe-ext-dropless-arena")


# Why the probabilities cannot scale the rows' copy under MXFP8 payloads (moe/layer.py, the launcher).
MXFP8_PROBS_ON_INPUT = ("moe_apply_probs_on_input (--moe-apply-probs-on-input) scales the experts' input rows, and "
                        "with --moe-ext-mxfp8-dispatch fc1 reads the MXFP8 payload instead of those rows (the "
                        "probabilities would be dropped): drop one of the two")
# Why fp16 rows cannot travel as MXFP8 (moe/layer.py, the launcher): the quantizers widen bf16 and fp32
# rows only, so an fp16 model would build and then fail at its first forward, deep in the dispatch.
MXFP8_FP16 = ("--moe-ext-mxfp8-dispatch quantizes bf16 (--bf16) or fp32 rows, and --fp16 makes the dispatched "
              "rows fp16: train with --bf16, or drop --moe-ext-mxfp8-dispatch")


def arena_args_problems(args) -> list[str]:
    """The launcher's early form of the experts' arena check (sizes are left to the layer's)."""
    problems = []
    if not getattr(args, "swiglu", False) or getattr(args, "add_bias_linear", True):
        problems.append(ARENA_NEEDS_FAST_PATH)
    if getattr(args, "moe_apply_probs_on_input", False):
        problems.append(ARENA_PROBS_ON_INPUT)
    return problems


def expert_problems(settings: ExpertSettings) -> list[str]:
    """What DeviceOffsetGroupedMLP cannot serve. The rowwise dispatcher refuses these; with
    dispatcher="megatron" the MoE layer builds Megatron's own experts instead (specs.moe_builder)."""
    problems = list(settings.refused)
    if settings.etp != 1:
        problems.append(f"the grouped experts are not sharded over tensor parallelism "
                        f"(expert_tensor_parallel_size={settings.etp}, --expert-tensor-parallel-size {settings.etp}); "
                        f"use --expert-tensor-parallel-size 1 and fold the experts over "
                        f"--expert-model-parallel-size instead")
    if settings.offloaded:
        modules = " ".join(settings.offloaded)
        problems.append(f"offload_modules {list(settings.offloaded)} (--fine-grained-activation-offloading "
                        f"--offload-modules {modules}): the grouped experts do not offload their activations to "
                        f"the host; drop those modules, or save the activation's memory with {MOE_ACT_RECOMPUTE}")
    if settings.gated and settings.glu_interleave is not None:
        problems.append(f"moe_mlp_glu_interleave_size={settings.glu_interleave} (--moe-mlp-glu-interleave-size "
                        f"{settings.glu_interleave}) is TEGroupedMLP's interleaved fc1 layout; the grouped experts "
                        f"keep SequentialMLP's [gate; up] layout: drop it")
    return problems
