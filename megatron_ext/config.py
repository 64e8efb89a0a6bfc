"""MoEExtConfig: every setting of the extension, validated in one place.

Built from keyword arguments or from Megatron's parsed args (`megatron_ext.arguments`); no
behaviour is switched by environment variables.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields

DISPATCHERS = ("rowwise", "megatron")
OVERFLOW_POLICIES = ("auto", "drop", "error")
TRANSPORTS = ("auto", "torch", "symm", "deepep")
RETURN_TRANSFERS = ("get", "put")
ROUTER_GEMMS = ("triton", "cublas")
# What only the rowwise dispatcher reads: a changed value under dispatcher="megatron" is refused,
# not ignored (the fields with their own message there are checked first).
ROWWISE_ONLY = ("capacity_factor", "dropless", "arena_region_factor", "max_tokens_per_rank", "metrics_interval",
                "debug_poison", "lease_slots", "fused_route_map", "fused_router", "router_gemms", "peer_timeout_s")


@dataclass(frozen=True)
class MoEExtConfig:
    """Settings of megatron_ext's MoE parts.

    dispatcher: "rowwise" (device route map + row transfers) or "megatron" (keep Megatron's
        dispatcher, swap only the experts for DeviceOffsetGroupedMLP).
    transport: how rows move for "rowwise": "torch" (all_to_all_single reference, any
        backend), "symm" (symmetric memory + Triton PUT/GET, GPUs in one NVLink domain),
        "deepep" (DeepEP, optional package), "auto" (symm on GPUs in one NVLink domain, else
        torch).
    return_transfer: how the symm transport brings rows back to their tokens (combine forward,
        dispatch backward): "get" (sources read the owners' rows; at EP > 1 after a copy of them
        into symmetric scratch) or "put" (owners write them into the sources' receive buffers;
        moe/transport/put_return.py). Other transports ignore "get" and refuse "put".
    capacity_factor: per-destination-rank capacity C = round_up(ceil(cf * T_max * K), 16).
    dropless: size C for the worst case (EP * T_max * K): nothing is ever dropped.
    on_overflow: what routes beyond the capacity mean. "drop": the fair keep policy drops them and
        the metrics count them. "error": bounded dropless: C stays cf * T_max * K (no worst-case
        buffers), no route may be dropped, and an overflow stops training with a clear error at
        the next check (`RowwiseMoELayer.check_overflow`, run by megatron_ext.training_hooks
        every logging interval: one host read, never per layer; a training loop of your own calls
        it). "auto" (default): "error" with dropless_arena (a dropless mode never drops silently),
        "drop" otherwise; `overflow_policy` is the policy in force.
    dropless_arena: bounded dropless with one budget for the MoE layers of a microbatch
        (moe/arena.py, "regions and spill"): capacity_factor * T_max * K rows per layer on average,
        shared by the layers (a layer may take more where another takes less); routes beyond the
        microbatch's budget follow on_overflow. Needs the layers attached to their arena
        (megatron_ext.moe.arena.attach_arenas; megatron.training runs do it at the first step),
        keeps the experts' activation in the arena too (recomputed instead under Megatron's
        --recompute-modules moe_act), and runs the SwiGLU experts without biases.
    arena_region_factor: rows of each layer's own region in the arena, in T_max * K units (at most
        capacity_factor); the rest of the budget is the shared area that loads above it spill into.
    max_tokens_per_rank: T_max, the static number of tokens a rank holds in one microbatch;
        None fixes it from the first forward's input shape (static in Megatron training), the
        largest of the EP group's (one all-reduce at each layer's first forward).
    mxfp8_dispatch: carry dispatched rows as MXFP8 (E4M3 + E8M0 per 32 values).
    cuda_graphs: capture the whole MoE layer (forward and backward) in CUDA graphs.
    ddp_buckets: Megatron's DDP with its reduction groups checked against the mesh and every bucket
        group launched in one order on all ranks (megatron_ext.ddp.megatron_hook.install_folding_ddp),
        applied by megatron_ext's training hook under megatron.training; not a layer setting
        (the layer builder refuses it: in your own loop, wrap the DDP yourself).
    metrics_interval: read routing metrics on the host every N steps (0: never).
    replica_check_interval: every N steps compare parameter checksums across each replica group
        (dense over DP x CP, experts over EP_DP) and name the first parameter that disagrees
        (0: never; the check synchronizes with the host).
    debug_poison: fill capacity tails and freshly taken receive buffers (dispatch slots, scratch,
        arena slots) with NaN, fenced across EP ranks, so stale reads show up.
    debug_checks: extra validation that synchronizes with the host (debug only).
    lease_slots: dispatch-buffer slots per layer (live microbatches per layer) of the symm transport,
        the arena and the graph runner; refused with the torch or deepep transport without those.
    fused_route_map: on GPUs, select routes and build the route map in two Triton kernels
        (moe/fused_routes.py; same results as the torch form, ~1 ms less host time per layer).
    fused_router: on GPUs, run Megatron's softmax top-k routing and its load-balancing loss in one
        Triton kernel each way (moe/fused_router.py; rowwise dispatcher; same results to fp32
        rounding, ~0.6 ms less host time per layer step). Router configurations it does not fuse
        run Megatron's own routing. Applies with fused_route_map (it feeds that route map).
    router_gemms: where the fused router's gating GEMMs run with bf16 tokens and an fp32 router
        (Megatron's --moe-router-dtype fp32 under --bf16): "triton" (inside the routing kernels, plus
        one kernel for the weight's gradient; no cuBLAS in the layer step: 9-11% less host time per
        layer step on the lent H200 hosts, 0-7% more device time, most at small token counts; up to
        256 experts, more use cuBLAS) or "cublas". Same results to fp32 rounding of the logits. Eager
        and CUDA-graphed layers use the same GEMMs, so their results stay bitwise equal.
    peer_timeout_s: how long a rank of the symm transport waits on its expert-parallel peers in a
        device barrier (count exchange, transfers) before it ends with a message naming the phase;
        None follows Megatron's --distributed-timeout-minutes (else torch's default process-group
        timeout, 30 min). The torch transport's waits are process-group collectives, bounded by the
        group's own timeout (--distributed-timeout-minutes): refused with transport="torch" or "deepep".
    pin_host_threads: keep the threads that submit the layer's work (the main thread, PyTorch's
        autograd thread) on one CPU core, this rank's share of its allowed cores
        (megatron_ext/host_affinity.py; Linux). In the one kept run timed in turns the eager layer's
        host time fell 9% (x0.91, per-round 0.79..1.21, bench/results/host_affinity_20261202-011631.json;
        a later short run measured x1.07); the training bench's step time did not change
        (BENCHMARKS.md, eighth session).
    expert_wgrad_fusion: under Megatron's DDP, the grouped experts add their fc1 and fc2 weight
        gradients to main_grad inside the weight-gradient GEMM, in fp32, instead of handing DDP a
        16-bit gradient to add (moe/expert_wgrad.py; biases and sizes off 16 bytes keep DDP's add):
        Megatron's gradient_accumulation_fusion contract, with no APEX or Transformer Engine
        needed, and independent of that flag: the weights' .grad (or torch.autograd.grad's result)
        is then an unwritten placeholder, the gradient being in main_grad. Both dispatchers.
        False keeps DDP's add (and a real .grad).
    """

    dispatcher: str = "rowwise"
    transport: str = "auto"
    return_transfer: str = "get"
    capacity_factor: float = 1.25
    dropless: bool = False
    on_overflow: str = "auto"
    dropless_arena: bool = False
    arena_region_factor: float = 1.0
    max_tokens_per_rank: int | None = None
    mxfp8_dispatch: bool = False
    cuda_graphs: bool = False
    ddp_buckets: bool = False
    metrics_interval: int = 0
    replica_check_interval: int = 0
    debug_poison: bool = False
    debug_checks: bool = False
    lease_slots: int = 1
    fused_route_map: bool = True
    fused_router: bool = True
    router_gemms: str = "triton"
    peer_timeout_s: float | None = None
    pin_host_threads: bool = False
    expert_wgrad_fusion: bool = True

    def __new__(cls, *args, **kwargs):
        """A misspelt setting is named with the closest fields (Python's own error names none)."""
        unknown = [name for name in kwargs if name not in _FIELD_NAMES]
        if unknown:
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, _FIELD_NAMES, n=2, cutoff=0.7)
                hints.append(f"{name!r}" + (f" (did you mean {' or '.join(close)}?)" if close else ""))
            raise TypeError(f"MoEExtConfig has no setting {', '.join(hints)}; its settings: "
                            f"{', '.join(_FIELD_NAMES)}")
        return super().__new__(cls)

    def __post_init__(self):
        wrong_types = list(self._type_problems())
        if wrong_types:
            raise TypeError(_one_message(wrong_types))
        problems = list(self._value_problems())
        if problems:
            raise ValueError(_one_message(problems))

    def _type_problems(self):
        """A value of the wrong type (bool is not an int here, a string is not a number)."""
        expected = {name: ((bool,), "True or False") for name in (
            "dropless", "dropless_arena", "mxfp8_dispatch", "cuda_graphs", "ddp_buckets", "debug_poison",
            "debug_checks", "fused_route_map", "fused_router", "pin_host_threads", "expert_wgrad_fusion")}
        expected.update({name: ((int,), "an integer") for name in ("metrics_interval", "replica_check_interval",
                                                                 "lease_slots")})
        expected["max_tokens_per_rank"] = ((int, type(None)), "an integer or None")
        expected["capacity_factor"] = ((int, float), "a number such as 1.25")
        expected["arena_region_factor"] = ((int, float), "a number such as 1.0")
        expected["peer_timeout_s"] = ((int, float, type(None)), "a number of seconds or None")
        for name, (kinds, wanted) in expected.items():
            value = getattr(self, name)
            if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
                yield f"{name} must be {wanted}, got {value!r} ({type(value).__name__})"

    def _value_problems(self):
        """Every bad value or combination, each with what to do; the caller reports them all at once."""
        for name, value, choices, what in (
                ("dispatcher", self.dispatcher, DISPATCHERS, "MoE dispatcher"),
                ("transport", self.transport, TRANSPORTS, "row transport"),
                ("return_transfer", self.return_transfer, RETURN_TRANSFERS, "return_transfer"),
                ("router_gemms", self.router_gemms, ROUTER_GEMMS, "router_gemms"),
                ("on_overflow", self.on_overflow, OVERFLOW_POLICIES, "on_overflow policy")):
            if value not in choices:
                yield f"unknown {what} {value!r}; choose one of {choices}"
        if self.peer_timeout_s is not None and not (self.peer_timeout_s > 0 and math.isfinite(self.peer_timeout_s)):
            yield f"peer_timeout_s must be > 0 seconds (or None), got {self.peer_timeout_s}"
        if not (self.capacity_factor > 0 and math.isfinite(self.capacity_factor)):
            yield (f"capacity_factor must be > 0 and finite, got {self.capacity_factor}; "
                   f"use e.g. 1.25, or dropless=True to never drop routes")
        if not (self.arena_region_factor > 0 and math.isfinite(self.arena_region_factor)):
            yield f"arena_region_factor must be > 0 and finite, got {self.arena_region_factor}"
        for name, lowest, also in (("max_tokens_per_rank", 1, " (or None)"), ("metrics_interval", 0, ""),
                                   ("replica_check_interval", 0, ""), ("lease_slots", 1, "")):
            value = getattr(self, name)
            if value is not None and value < lowest:
                yield f"{name} must be >= {lowest}{also}, got {value}"
        if self.on_overflow == "error" and self.dropless:
            yield ("on_overflow='error' bounds the capacity by capacity_factor (bounded dropless); "
                   "dropless=True sizes it for the worst case instead: choose one")
        if self.return_transfer == "put":
            yield from self._return_put_problems()
        if self.dropless_arena:
            yield from self._arena_problems()
        if self.cuda_graphs and self.debug_checks:
            yield ("cuda_graphs with debug_checks: the checks read device values on the host, which a CUDA "
                   "graph capture cannot contain (the layer would run eagerly); drop one")
        if self.dispatcher == "rowwise":
            yield from self._unused_problems()
        if self.dispatcher == "megatron":
            yield from self._megatron_dispatcher_problems()

    def _megatron_dispatcher_problems(self):
        """Rowwise-only settings under dispatcher='megatron': refused, not ignored."""
        if self.mxfp8_dispatch:
            yield ("mxfp8_dispatch needs dispatcher='rowwise' (the payload is quantized inside "
                   "the rowwise dispatch), got dispatcher='megatron'")
        if self.cuda_graphs:
            yield ("cuda_graphs captures the synchronization-free rowwise layer; Megatron's "
                   "dispatchers synchronize with the host (dispatcher='megatron'). Use dispatcher='rowwise'.")
        if self.pin_host_threads:
            yield ("pin_host_threads applies to the rowwise layer (dispatcher='rowwise'), whose "
                   "forward and backward pin their threads; dispatcher='megatron' builds Megatron's MoELayer")
        if self.on_overflow != "auto":
            yield ("on_overflow applies to dispatcher='rowwise' (Megatron's dispatchers are dropless "
                   "or drop by their own settings)")
        if self.transport != "auto":
            yield (f"transport={self.transport!r} only applies to dispatcher='rowwise'; "
                   f"dispatcher='megatron' moves tokens with Megatron's moe_token_dispatcher_type "
                   f"(leave transport='auto')")
        changed = [name for name in self.changed_fields() if name in ROWWISE_ONLY]
        if changed:
            verb, it, defaults = ("applies", "it", "its default") if len(changed) == 1 else \
                ("apply", "them", "their defaults")
            yield (f"{', '.join(changed)} only {verb} to dispatcher='rowwise' (dispatcher='megatron' sizes, routes "
                   f"and moves tokens by Megatron's own --moe-* settings and would ignore {it}): leave {it} at "
                   f"{defaults} or use dispatcher='rowwise'")

    def changed_fields(self) -> list[str]:
        """The fields set to something other than their default, in declaration order."""
        return [f.name for f in fields(self) if getattr(self, f.name) != f.default]

    @property
    def overflow_policy(self) -> str:
        """The policy in force: on_overflow, with "auto" resolved ("error" with the dropless arena)."""
        if self.on_overflow == "auto":
            return "error" if self.dropless_arena else "drop"
        return self.on_overflow

    @property
    def drops_routes(self) -> bool:
        """The rowwise layer drops the routes beyond its capacity (a capacity factor of EP or more
        is dropless too: moe/capacity.py caps it at the worst case)."""
        return self.dispatcher == "rowwise" and self.overflow_policy == "drop" and not self.dropless

    def _unused_problems(self):
        """A rowwise setting another setting makes do nothing: refused, not ignored."""
        changed = self.changed_fields()
        for name, unused, why in (
                ("capacity_factor", self.dropless, "dropless=True sizes every buffer for the worst case"),
                ("on_overflow", self.dropless and self.on_overflow == "drop",
                 "dropless=True sizes every buffer for the worst case, so no route can overflow"),
                ("arena_region_factor", not self.dropless_arena, "it sizes the regions of the dropless arena "
                                                                 "(dropless_arena=True)"),
                ("router_gemms", not (self.fused_router and self.fused_route_map),
                 "it places the fused router's GEMMs, and fused_router=False or fused_route_map=False turns that "
                 "router off (it hands its selection to the fused route map)"),
                ("peer_timeout_s", self.transport in ("torch", "deepep"),
                 "it bounds the symm transport's device barriers; the torch transport's waits are collectives of the "
                 "process group, bounded by its timeout (--distributed-timeout-minutes), and DeepEP's by its own"),
                ("lease_slots", self.transport in ("torch", "deepep") and not (self.cuda_graphs or self.dropless_arena),
                 f"the {self.transport} transport's buffers belong to autograd (any number of microbatches may be "
                 f"live); lease slots size the symm transport's dispatch buffers, the arena's and the graph slots")):
            if name in changed and unused:
                yield f"{name}={getattr(self, name)!r} does nothing here: {why}; leave it at its default"

    def _arena_problems(self):
        if self.dropless:
            yield ("dropless_arena bounds the buffers by one budget per microbatch; dropless=True sizes "
                   "every layer for the worst case instead: choose one")
        # A non-positive or non-finite factor is already reported by _value_problems.
        if 0 < self.arena_region_factor < math.inf and not self.arena_region_factor <= self.capacity_factor:
            yield (f"arena_region_factor must be > 0 and at most capacity_factor ({self.capacity_factor}): "
                   f"the regions are part of the budget; got {self.arena_region_factor}")
        for name, wrong, why in (
                ("dispatcher", self.dispatcher != "rowwise", "the arena holds the rowwise dispatcher's buffers"),
                ("transport", self.transport == "deepep", "DeepEP owns its receive buffers"),
                ("mxfp8_dispatch", self.mxfp8_dispatch, "the arena keeps BF16 rows (not built for MXFP8 payloads)")):
            if wrong:
                yield f"dropless_arena cannot run with {name}={getattr(self, name)!r}: {why}"

    def _return_put_problems(self):
        for name, wrong, why in (
                ("dispatcher", self.dispatcher != "rowwise", "it is a mode of the rowwise dispatcher's symm transport"),
                ("transport", self.transport in ("torch", "deepep"), "it is a mode of the symm transport")):
            if wrong:
                yield (f"return_transfer='put' cannot run with {name}={getattr(self, name)!r}: {why}; "
                       f"use return_transfer='get'")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _one_message(problems: list[str]) -> str:
    """One problem as it is; several as a list, so a user fixes them in one go."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems in the MoE settings:\n  - " + "\n  - ".join(problems)


_FIELD_NAMES = tuple(f.name for f in fields(MoEExtConfig))
