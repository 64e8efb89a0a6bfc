"""Per-rank model-state memory of a MoE GPT model on a Parallel Folding mesh (no GPU needed).

Counts parameters, gradient buffers and optimizer states per rank, split into dense parts
(attention, norms, router, dense MLPs, shared experts, embeddings) and routed-expert parts.
Activations, CUDA/NCCL workspaces, EP communication buffers and fragmentation are NOT counted:
the "fits" verdict is about model states only, and the headroom is what activations get.

Assumptions (Megatron-Core 0.19.2 GPT with --disable-bias-linear, gated SwiGLU by default):
  * attention: QKV (h x (h + 2*kv)) + output projection (h x h), sharded over TP; kv = h for
    MHA, query_groups * h / heads for GQA; two norms of h per layer, replicated over TP;
  * MoE layer: router E x h (replicated over TP, counted dense); routed experts
    (E/EP) x 3*h*moe_ffn / ETP per rank (2*h*moe_ffn without SwiGLU); shared expert
    3*h*shared_ffn / TP (dense);
  * the first `dense_layers` layers use a dense MLP 3*h*ffn / TP instead of MoE;
  * layers split evenly over PP (and VPP chunks, interleaved as Megatron does);
  * word embedding on the first stage and output layer on the last, each padded_vocab*h/TP,
    padded_vocab rounded up to a multiple of 128*TP; tied embeddings share one copy only
    when PP = 1 (with PP > 1 the last stage keeps its own copy); final norm on the last stage;
  * params in --dtype; gradient buffers fp32 for bf16 (Megatron accumulates bf16 grads in
    fp32 by default), else in the param dtype, unless grad_dtype says otherwise;
  * Adam: fp32 exp_avg + exp_avg_sq (8 B) plus an fp32 master copy (4 B) when params are not
    fp32; SGD: fp32 momentum plus the master copy;
  * --distributed-optimizer shards optimizer states (not params, not grad buffers) over
    DP*CP for dense params and over EDP (EP_DP) for expert params.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ext.parallel.folding import FoldingMesh
from megatron_ext.parallel.render import text_table

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
OPTIMIZERS = ("adam", "sgd")
GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """A MoE GPT model's sizes (Megatron argument names in comments)."""

    layers: int  # --num-layers
    hidden: int  # --hidden-size
    moe_ffn: int  # --moe-ffn-hidden-size
    experts: int  # --num-experts
    topk: int  # --moe-router-topk
    vocab: int  # tokenizer vocabulary before padding
    ffn: int | None = None  # --ffn-hidden-size of dense layers; default 4 * hidden
    dense_layers: int = 0  # leading dense layers (--moe-layer-freq [0]*k + [1]*(L-k))
    shared_expert_ffn: int = 0  # --moe-shared-expert-intermediate-size
    heads: int | None = None  # --num-attention-heads (needed only for GQA)
    query_groups: int | None = None  # --num-query-groups (GQA); None = MHA
    swiglu: bool = True
    tie_embeddings: bool = False
    vocab_divisible_by: int = 128  # --make-vocab-size-divisible-by

    def __post_init__(self):
        if self.ffn is None:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        for name in ("layers", "hidden", "moe_ffn", "experts", "topk", "vocab", "ffn", "vocab_divisible_by"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0 <= self.shared_expert_ffn:
            raise ValueError(f"shared_expert_ffn must be >= 0, got {self.shared_expert_ffn}")
        if self.topk > self.experts:
            raise ValueError(f"topk {self.topk} exceeds the number of experts {self.experts}")
        if not 0 <= self.dense_layers <= self.layers:
            raise ValueError(f"dense_layers {self.dense_layers} must be in [0, layers = {self.layers}]")
        if self.query_groups is not None:
            if self.heads is None:
                raise ValueError("query_groups (GQA) needs heads")
            if self.heads % self.query_groups:
                raise ValueError(f"heads {self.heads} is not divisible by query_groups {self.query_groups}")
        if self.heads is not None and self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices per MLP: 3 with gated SwiGLU (gate, up, down), else 2."""
        return 3 if self.swiglu else 2

    @property
    def kv_width(self) -> int:
        """Width of K (and of V): hidden for MHA, query_groups * head_dim for GQA."""
        if self.query_groups is None:
            return self.hidden
        return self.query_groups * (self.hidden // self.heads)

    def padded_vocab(self, tp: int) -> int:
        """Megatron pads the vocabulary up to a multiple of vocab_divisible_by * TP."""
        multiple = self.vocab_divisible_by * tp
        return -(-self.vocab // multiple) * multiple

    def attention_params(self) -> int:
        h = self.hidden
        return h * (h + 2 * self.kv_width) + h * h

    def expert_params(self) -> int:
        """Parameters of one routed expert."""
        return self.mlp_matrices * self.hidden * self.moe_ffn

    def total_and_active_params(self) -> tuple[int, int]:
        """Whole-model parameter count and the parameters one token uses (top-k experts)."""
        h, moe_layers = self.hidden, self.layers - self.dense_layers
        per_layer_common = self.attention_params() + 2 * h
        dense_mlp = self.mlp_matrices * h * self.ffn
        moe_dense = self.experts * h + self.mlp_matrices * h * self.shared_expert_ffn
        embeddings = self.vocab * h * (1 if self.tie_embeddings else 2) + h
        common = self.layers * per_layer_common + self.dense_layers * dense_mlp + moe_layers * moe_dense + embeddings
        return (common + moe_layers * self.experts * self.expert_params(),
                common + moe_layers * self.topk * self.expert_params())


@dataclass(frozen=True)
class Precision:
    """Training precision and optimizer choices that set bytes per parameter."""

    param_dtype: str = "bf16"
    grad_dtype: str | None = None  # None: fp32 for bf16 params, else the param dtype
    optimizer: str = "adam"
    distributed_optimizer: bool = False

    def __post_init__(self):
        if self.param_dtype not in DTYPE_BYTES:
            raise ValueError(f"param_dtype {self.param_dtype!r} not in {sorted(DTYPE_BYTES)}")
        if self.grad_dtype is None:
            object.__setattr__(self, "grad_dtype", "fp32" if self.param_dtype == "bf16" else self.param_dtype)
        if self.grad_dtype not in DTYPE_BYTES:
            raise ValueError(f"grad_dtype {self.grad_dtype!r} not in {sorted(DTYPE_BYTES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} not in {list(OPTIMIZERS)}")

    def optimizer_bytes_per_param(self) -> int:
        """Adam: 8 B of fp32 moments; SGD: 4 B of fp32 momentum; +4 B fp32 master copy when
        params are not fp32."""
        states = 8 if self.optimizer == "adam" else 4
        master = 0 if self.param_dtype == "fp32" else 4
        return states + master


@dataclass(frozen=True)
class Split:
    """A quantity split into dense and routed-expert parts."""

    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


@dataclass(frozen=True)
class StageMemory:
    """Model-state memory of every rank of one pipeline stage (all its ranks are equal)."""

    stage: int
    ranks: int
    dense_layers: int
    moe_layers: int
    has_embedding: bool
    has_output_layer: bool
    embedding_params: int  # word embedding + output layer on this rank (part of params.dense)
    params: Split  # parameter counts per rank
    param_bytes: Split
    grad_bytes: Split
    optimizer_bytes: Split

    @property
    def total_bytes(self) -> int:
        return self.param_bytes.total + self.grad_bytes.total + self.optimizer_bytes.total


def check_model_on_mesh(model: ModelShape, mesh: FoldingMesh) -> None:
    """Divisibility rules Megatron enforces between the model and the parallel sizes."""
    chunks = mesh.pp * (mesh.vpp or 1)
    rules = [
        (model.layers % chunks == 0, f"layers {model.layers} is not divisible by PP*VPP = {chunks}"),
        (model.experts % mesh.ep == 0, f"experts {model.experts} is not divisible by EP = {mesh.ep}"),
        (model.moe_ffn % mesh.etp == 0, f"moe_ffn {model.moe_ffn} is not divisible by ETP = {mesh.etp}"),
        (model.hidden % mesh.tp == 0, f"hidden {model.hidden} is not divisible by TP = {mesh.tp}"),
        (model.dense_layers == 0 or model.ffn % mesh.tp == 0, f"ffn {model.ffn} is not divisible by TP = {mesh.tp}"),
        (model.shared_expert_ffn % mesh.tp == 0,
         f"shared_expert_ffn {model.shared_expert_ffn} is not divisible by TP = {mesh.tp}"),
        (model.heads is None or model.heads % mesh.tp == 0, f"heads {model.heads} is not divisible by TP = {mesh.tp}"),
        (model.query_groups is None or model.query_groups % mesh.tp == 0,
         f"query_groups {model.query_groups} is not divisible by TP = {mesh.tp}"),
    ]
    for ok, message in rules:
        if not ok:
            raise ValueError(message)


def stage_layers(model: ModelShape, mesh: FoldingMesh, stage: int) -> list[int]:
    """Global layer indices on `stage`: chunk v of stage s holds layers [(v*PP + s)*n, ...+n)
    with n = layers / (PP*VPP) (Megatron's interleaved assignment; VPP=1 is the plain split)."""
    vpp = mesh.vpp or 1
    n = model.layers // (mesh.pp * vpp)
    return [layer for v in range(vpp) for layer in range((v * mesh.pp + stage) * n, (v * mesh.pp + stage + 1) * n)]


def estimate_stage(model: ModelShape, mesh: FoldingMesh, precision: Precision, stage: int) -> StageMemory:
    """Per-rank parameter, gradient and optimizer bytes on pipeline stage `stage`."""
    h, tp = model.hidden, mesh.tp
    layers = stage_layers(model, mesh, stage)
    dense_layers = sum(1 for layer in layers if layer < model.dense_layers)
    moe_layers = len(layers) - dense_layers
    first, last = stage == 0, stage == mesh.pp - 1

    per_layer = model.attention_params() // tp + 2 * h
    dense = len(layers) * per_layer
    dense += dense_layers * model.mlp_matrices * h * model.ffn // tp
    dense += moe_layers * (model.experts * h + model.mlp_matrices * h * model.shared_expert_ffn // tp)
    table = model.padded_vocab(tp) * h // tp
    embedding = (table if first else 0)
    if last and not (model.tie_embeddings and mesh.pp == 1):
        embedding += table
    dense += embedding + (h if last else 0)
    expert = moe_layers * (model.experts // mesh.ep) * model.expert_params() // mesh.etp
    params = Split(dense, expert)

    p_bytes, g_bytes = DTYPE_BYTES[precision.param_dtype], DTYPE_BYTES[precision.grad_dtype]
    o_bytes = precision.optimizer_bytes_per_param()
    # Megatron shards over DP x CP and EDP divided by --num-distributed-optimizer-instances (each
    # instance keeps a full copy: distributed_data_parallel.py, intra_dp_cp / intra_expt_dp).
    instances = mesh.dist_opt_instances
    dense_shards, expert_shards = ((mesh.dp * mesh.cp // instances, mesh.edp // instances)
                                   if precision.distributed_optimizer else (1, 1))
    return StageMemory(
        stage=stage, ranks=mesh.ranks_per_stage, dense_layers=dense_layers, moe_layers=moe_layers,
        has_embedding=first, has_output_layer=last, embedding_params=embedding, params=params,
        param_bytes=Split(dense * p_bytes, expert * p_bytes),
        grad_bytes=Split(dense * g_bytes, expert * g_bytes),
        optimizer_bytes=Split(-(-dense * o_bytes // dense_shards), -(-expert * o_bytes // expert_shards)),
    )


def estimate(model: ModelShape, mesh: FoldingMesh, precision: Precision) -> list[StageMemory]:
    """StageMemory for every pipeline stage (validates the model against the mesh first)."""
    check_model_on_mesh(model, mesh)
    return [estimate_stage(model, mesh, precision, s) for s in range(mesh.pp)]


def fits(stage: StageMemory, gpu_mem_gib: float) -> bool:
    """Model states alone fit in the GPU memory (activations are not counted)."""
    return stage.total_bytes <= gpu_mem_gib * GIB


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def render_memory(model: ModelShape, mesh: FoldingMesh, precision: Precision, stages: list[StageMemory],
                  gpu_mem_gib: float | None = None) -> str:
    """A text table: one row per pipeline stage (every rank of a stage holds the same bytes)."""
    total, active = model.total_and_active_params()
    instances = mesh.dist_opt_instances
    per_instance = f" per distributed-optimizer instance ({instances} instances)" if instances > 1 else ""
    shards = (f"optimizer states sharded over DP*CP = {mesh.dp * mesh.cp // instances} (dense) and "
              f"EDP = {mesh.edp // instances} (experts){per_instance}"
              if precision.distributed_optimizer else "optimizer states not sharded (no distributed optimizer)")
    dense_note = (f"{model.dense_layers} dense with ffn {model.ffn}" if model.dense_layers
                  else "all MoE, --ffn unused")
    lines = [
        f"Model: {total / 1e9:.2f} B parameters, {active / 1e9:.2f} B active per token "
        f"({model.layers} layers, {dense_note}; hidden {model.hidden}; "
        f"{model.experts} experts top-{model.topk}, moe_ffn {model.moe_ffn}; vocab {model.vocab} "
        f"padded to {model.padded_vocab(mesh.tp)})",
        f"Bytes per parameter: params {precision.param_dtype} {DTYPE_BYTES[precision.param_dtype]}, "
        f"grads {precision.grad_dtype} {DTYPE_BYTES[precision.grad_dtype]}, "
        f"{precision.optimizer} states {precision.optimizer_bytes_per_param()}; {shards}",
        "Per rank, GiB, model states only (activations, EP buffers and workspaces excluded):",
    ]
    headers = ["stage", "ranks", "layers d/moe", "emb", "params dense", "params expert",
               "param GiB d/e", "grad GiB d/e", "optim GiB d/e", "total GiB"]
    if gpu_mem_gib is not None:
        headers.append(f"fits {gpu_mem_gib:g} GiB")
    rows = []
    for s in stages:
        emb = "+".join(n for n, on in (("in", s.has_embedding), ("out", s.has_output_layer)) if on) or "-"
        row = [str(s.stage), str(s.ranks), f"{s.dense_layers}/{s.moe_layers}", emb,
               f"{s.params.dense / 1e6:,.1f} M", f"{s.params.expert / 1e6:,.1f} M",
               f"{_gib(s.param_bytes.dense)}/{_gib(s.param_bytes.expert)}",
               f"{_gib(s.grad_bytes.dense)}/{_gib(s.grad_bytes.expert)}",
               f"{_gib(s.optimizer_bytes.dense)}/{_gib(s.optimizer_bytes.expert)}",
               _gib(s.total_bytes)]
        if gpu_mem_gib is not None:
            left = gpu_mem_gib * GIB - s.total_bytes
            row.append(f"yes, {left / GIB:.1f} GiB left" if left >= 0 else f"NO, over by {-left / GIB:.1f} GiB")
        rows.append(row)
    lines.append(text_table(headers, rows, indent="  "))
    if gpu_mem_gib is not None:
        bad = [s.stage for s in stages if not fits(s, gpu_mem_gib)]
        lines.append(
            f"DOES NOT FIT: stages {bad} need more than {gpu_mem_gib:g} GiB for model states alone"
            if bad else
            f"Fits: the largest stage needs {_gib(max(s.total_bytes for s in stages))} GiB of {gpu_mem_gib:g} GiB "
            f"before activations")
    return "\n".join(lines)
