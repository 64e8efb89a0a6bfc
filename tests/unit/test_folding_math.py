"""Parallel Folding mesh math against Megatron 0.19.2's RankGenerator, the validation rules,
the memory estimator against a hand computation, and the tools/mesh.py CLI."""

import itertools
import os
import re
import subprocess
import sys

import pytest
from megatron.core.parallel_state import RankGenerator, _inject_gtp_remat_axis

from megatron_ext.parallel.folding import FoldingMesh
from megatron_ext.parallel.rank_groups import ATTENTION_KINDS, EXPERT_KINDS, rank_groups
from megatron_ext.parallel.memory import GIB, ModelShape, Precision, estimate, fits, render_memory, stage_layers
from megatron_ext.parallel.render import short_list, text_table

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (world, tp, cp, pp, ep, etp, order)
LAYOUTS = [
    (8, 2, 1, 1, 4, None, "tp-cp-ep-dp-pp"),  # TP2 EP4 (ETP = TP)
    (16, 2, 2, 1, 4, None, "tp-cp-ep-dp-pp"),  # TP2 CP2 EP4
    (8, 2, 2, 1, 2, 1, "tp-cp-ep-dp-pp"),  # ETP != TP, CP folded into EP
    (8, 1, 1, 2, 2, None, "tp-cp-ep-dp-pp"),  # PP2
    (4, 1, 1, 1, 2, 2, "tp-cp-ep-dp-pp"),  # ETP > TP
    (32, 2, 2, 2, 4, 1, "tp-cp-ep-dp-pp"),  # everything at once
    (16, 2, 1, 2, 2, 1, "tp-cp-ep-pp-dp"),  # pp not last, EDP == DP
    (16, 2, 1, 2, 1, None, "tp-pp-dp"),  # order without cp and ep
    (24, 1, 3, 2, 4, 1, "tp-cp-ep-dp-pp"),  # non power of two
    (64, 4, 1, 1, 8, 2, "tp-ep-cp-dp-pp"),  # a permuted order
    (512, 1, 1, 8, 8, None, "tp-cp-ep-dp-pp"),  # the report's 512-GPU layout
    (1024, 2, 2, 4, 16, 1, "tp-cp-ep-dp-pp"),
    (1024, 8, 1, 8, 8, 1, "tp-cp-ep-dp-pp"),
    (1024, 1, 4, 2, 32, 2, "tp-cp-ep-dp-pp"),
]


def megatron_generators(mesh):
    """Megatron's two RankGenerators, built exactly as initialize_model_parallel builds them."""
    attention = RankGenerator(tp=mesh.tp, ep=1, dp=mesh.dp, pp=mesh.pp, cp=mesh.cp,
                              order=_inject_gtp_remat_axis(mesh.order, after="tp"), gtp_remat=1)
    expert = RankGenerator(tp=mesh.etp, ep=mesh.ep, dp=mesh.edp, pp=mesh.pp, cp=1,
                           order=_inject_gtp_remat_axis(mesh.order, after="ep"), gtp_remat=1)
    return attention, expert


def megatron_token(axes):
    return "-".join(axes)


@pytest.mark.parametrize("world,tp,cp,pp,ep,etp,order", LAYOUTS)
def test_groups_equal_megatron_rank_generator(world, tp, cp, pp, ep, etp, order):
    mesh = FoldingMesh(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
    attention, expert = megatron_generators(mesh)
    for kind, axes in ATTENTION_KINDS.items():
        assert mesh.attention_groups(kind) == attention.get_ranks(megatron_token(axes)), kind
    for kind, axes in EXPERT_KINDS.items():
        assert mesh.expert_groups(kind) == expert.get_ranks(megatron_token(axes)), kind
    assert mesh.expert_groups("ep_mp") == expert.get_ranks("ep")
    assert mesh.expert_groups("ep_dp") == expert.get_ranks("dp")
    # Folding identity and every rank exactly once per kind.
    assert mesh.tp * mesh.cp * mesh.dp == mesh.etp * mesh.ep * mesh.edp == world // pp
    for groups in (mesh.attention_groups("dp_cp"), mesh.expert_groups("edp"), mesh.expert_groups("ep")):
        assert sorted(r for g in groups for r in g) == list(range(world))


@pytest.mark.parametrize("world,tp,cp,pp,ep,etp,order", LAYOUTS[:6])
def test_coordinates_rebuild_the_groups(world, tp, cp, pp, ep, etp, order):
    mesh = FoldingMesh(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
    for rank in range(world):
        a, e = mesh.attention_coordinates(rank), mesh.expert_coordinates(rank)
        assert a["pp"] == e["pp"]
        tp_group = mesh.group_of(rank, "tp")
        assert [mesh.attention_coordinates(r)["tp"] for r in tp_group] == list(range(tp))
        ep_group = mesh.group_of(rank, "ep", mesh="expert")
        assert [mesh.expert_coordinates(r)["ep"] for r in ep_group] == list(range(ep))
        assert ep_group.index(rank) == e["ep"]


def megatron_accepts(world, tp, cp, pp, ep, etp, order):
    """Run Megatron's own size checks of initialize_model_parallel (0.19.2) without groups."""
    etp = tp if etp is None else etp
    try:
        if world % (tp * pp * cp):
            return False
        dp = world // (tp * pp * cp)
        if world % (etp * ep * pp):
            return False
        edp = world // (etp * ep * pp)
        attention = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=_inject_gtp_remat_axis(order, "tp"))
        expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=_inject_gtp_remat_axis(order, "ep"))
        if not (order.endswith("pp") or pp == 1 or edp == dp):
            return False
        return attention.get_ranks("pp") == expert.get_ranks("pp")
    except (RuntimeError, KeyError, ZeroDivisionError, AssertionError):
        # AssertionError: with 'tp' missing from the order, RankGenerator's substring test
        # finds "tp" inside the injected "gtp_remat" and the enumeration asserts later.
        return False


def test_acceptance_matches_megatron_over_a_sweep():
    orders = ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-cp-ep-dp", "pp-tp-cp-ep-dp", "tp-ep-dp-pp", "tp-dp-pp"]
    checked = accepted = 0
    for world in (4, 8, 12, 16):
        for tp, cp, pp, ep, etp in itertools.product((1, 2, 4), (1, 2), (1, 2), (1, 2, 4), (None, 1, 2)):
            for order in orders:
                expected = megatron_accepts(world, tp, cp, pp, ep, etp, order)
                try:
                    mesh = FoldingMesh(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
                except ValueError as error:
                    assert not expected, (world, tp, cp, pp, ep, etp, order, str(error))
                else:
                    assert expected, (world, tp, cp, pp, ep, etp, order)
                    attention, expert = megatron_generators(mesh)
                    assert mesh.attention_groups("dp_cp") == attention.get_ranks("dp-cp")
                    assert mesh.expert_groups("edp") == expert.get_ranks("dp")
                    accepted += 1
                checked += 1
    assert checked > 1000 and 100 < accepted < checked


# (kwargs, regex of the message naming the rule, what Megatron does with it:
#  "rejects" = megatron_accepts() says no; "asserts" = initialize_model_parallel raises on a check
#  megatron_accepts does not run (VPP, partial distributed optimizer); "stricter" = we reject what
#  Megatron takes (malformed or unsupported input))
INVALID = [
    (dict(world_size=0), r"world_size must be >= 1, got 0", "stricter"),
    (dict(world_size=8, tp=0), r"tp must be >= 1, got 0", "rejects"),
    (dict(world_size=8, ep=2, etp=0), r"etp must be >= 1, got 0", "rejects"),
    (dict(world_size=8, ep="2"), r"ep must be an integer, got '2'", "stricter"),
    # bool is an int subclass: True would pass as a size of 1 (Megatron would take it)
    (dict(world_size=8, tp=True), r"tp must be an integer, got True", "stricter"),
    # vpp is optional, but when given it is a size like the others (Megatron would set a VPP world size 0)
    (dict(world_size=8, pp=2, vpp=0), r"vpp must be >= 1, got 0", "stricter"),
    (dict(world_size=24, tp=2, cp=2, pp=4), r"world_size 24 is not divisible by TP\*CP\*PP = 16", "rejects"),
    (dict(world_size=24, pp=2, ep=8), r"\(world/PP\) = 12 is not divisible by ETP\*EP = 8", "rejects"),
    (dict(world_size=8, pp=2, order="tp-cp-ep-dp"), r"does not name 'pp' but PP = 2", "rejects"),
    (dict(world_size=8, cp=2, order="tp-ep-dp-pp"), r"does not name 'cp' but CP = 2 in the attention", "rejects"),
    (dict(world_size=8, ep=2, order="tp-cp-dp-pp"), r"does not name 'ep' but EP = 2 in the expert", "rejects"),
    (dict(world_size=8, etp=2, order="cp-ep-dp-pp"), r"does not name 'tp': Megatron 0.19.2 inserts", "rejects"),
    (dict(world_size=8, order="tp-cp-ep-xp-pp"), r"unknown axis names \['xp'\]", "rejects"),
    (dict(world_size=8, order="tp-tp-dp-pp"), r"names \['tp'\] more than once", "stricter"),
    (dict(world_size=8, order="TP-CP-EP-DP-PP"), r"must be lowercase", "stricter"),
    (dict(world_size=8, order="tp--dp-pp"), r"empty axis name", "rejects"),
    (dict(world_size=8, order=None), r"order must be a non-empty string", "stricter"),
    (dict(world_size=8, order="tp-gtp_remat-cp-ep-dp-pp"), r"weight-rematerialization axis is not modelled",
     "stricter"),
    (dict(world_size=16, tp=2, pp=2, ep=2, etp=2, order="tp-cp-ep-pp-dp"),
     r"EDP = 2 must equal DP = 4 when PP = 2 > 1 and the order 'tp-cp-ep-pp-dp' does not end with 'pp'", "rejects"),
    (dict(world_size=16, tp=2, cp=2, pp=2, ep=4, etp=1, order="tp-pp-cp-ep-dp"),
     r"different PP groups for attention \(stride 2\) and experts \(stride 1\)", "rejects"),
    # Megatron's size checks pass this one; its initialize_model_parallel then fails in get_mask (a review)
    (dict(world_size=8, ep=2, order="ep-dp-pp"), r"does not name 'tp': Megatron 0.19.2 inserts its gtp_remat",
     "asserts"),
    (dict(world_size=8, vpp=2), r"VPP = 2 needs PP > 1", "asserts"),
    (dict(world_size=8, dist_opt_instances=3), r"DP\*CP = 8 is not divisible by dist_opt_instances = 3", "asserts"),
    (dict(world_size=8, ep=4, dist_opt_instances=4), r"EDP = 2 is not divisible by dist_opt_instances = 4", "asserts"),
]


@pytest.mark.parametrize("kwargs,message,megatron", INVALID, ids=[f"invalid{i}" for i in range(len(INVALID))])
def test_invalid_layouts_name_the_rule(kwargs, message, megatron):
    with pytest.raises(ValueError, match=message):
        FoldingMesh(**kwargs)
    if megatron == "rejects":
        args = dict(tp=1, cp=1, pp=1, ep=1, etp=None, order="tp-cp-ep-dp-pp")
        args.update({k: v for k, v in kwargs.items() if k != "world_size"})
        assert not megatron_accepts(kwargs["world_size"], **args)


def test_invalid_messages_are_distinct():
    messages = set()
    for kwargs, _, _ in INVALID:
        with pytest.raises(ValueError) as info:
            FoldingMesh(**kwargs)
        messages.add(str(info.value))
    assert len(messages) == len(INVALID) >= 10


def test_defaults_and_derived_sizes():
    mesh = FoldingMesh(512, pp=8, ep=8)
    assert (mesh.etp, mesh.dp, mesh.edp, mesh.ranks_per_stage) == (1, 64, 8, 64)
    assert mesh.stage_ranks(1) == list(range(64, 128))
    assert mesh.megatron_kwargs()["expert_tensor_parallel_size"] == 1
    assert FoldingMesh(16, tp=2, cp=2, ep=4).edp == 2  # D*C = 4*... : TP*CP*DP = 16 = ETP*EP*EDP
    with pytest.raises(ValueError, match="not in the mesh axes"):
        rank_groups((("tp", 2),), ("dp",))


def test_render_lists_both_meshes_per_stage():
    text = FoldingMesh(16, tp=2, cp=2, pp=2, ep=4, etp=1).render(gpus_per_node=8)
    assert "attention  TP 2 x CP 2 x DP 2 x PP 2" in text
    assert "experts    ETP 1 x EP 4 x EDP 2 x PP 2" in text
    assert "PP stage 0 (8 ranks)" in text and "PP stage 1 (8 ranks)" in text
    header = next(line for line in text.splitlines() if line.strip().startswith("rank"))
    assert header.split() == ["rank", "node", "tp", "cp", "dp", "|", "etp", "ep", "edp"]
    # rank 6: attention tp0 cp1 dp1, experts etp0 ep2 edp1
    row6 = next(line.split() for line in text.splitlines() if line.split()[:1] == ["6"])
    assert row6 == ["6", "0", "0", "1", "1", "|", "0", "2", "1"]


def test_partial_distributed_optimizer_divides_dp_times_cp():
    """Megatron's intra-partial DP group spans DP x CP, so dist_opt_instances must divide DP*CP, not DP:
    DP 2 x CP 2 over 4 instances is valid (EDP = 4 also divides)."""
    mesh = FoldingMesh(4, cp=2, dist_opt_instances=4)
    assert (mesh.dp, mesh.cp, mesh.edp) == (2, 2, 4)


def test_model_parallel_group_is_tp_times_pp():
    """tp_pp is Megatron's model-parallel group. The RankGenerator comparison above reads the axes from
    ATTENTION_KINDS itself, so only a literal catches a wrong axis there. World 8, TP2 PP2 (DP 2),
    order tp-cp-ep-dp-pp: strides tp 1, dp 2, pp 4."""
    mesh = FoldingMesh(8, tp=2, pp=2)
    assert mesh.attention_groups("tp_pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert mesh.attention_groups("tp_dp_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_megatron_kwargs_carry_every_mesh_size():
    # VPP and the distributed-optimizer instances reach initialize_model_parallel too
    mesh = FoldingMesh(8, tp=2, pp=2, ep=2, etp=1, vpp=2, dist_opt_instances=2)
    assert mesh.megatron_kwargs() == dict(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
        context_parallel_size=1, expert_model_parallel_size=2, expert_tensor_parallel_size=1,
        num_distributed_optimizer_instances=2, order="tp-cp-ep-dp-pp")


def test_short_list_keeps_up_to_limit_entries():
    # limit 8: exactly 8 ranks are listed in full; past it, the ends (and the step when regular)
    assert short_list(list(range(8))) == "[0, 1, 2, 3, 4, 5, 6, 7]"
    assert short_list(list(range(0, 18, 2))) == "[0, 2, ..., 16] (step 2)"
    assert short_list([0, 1, 3, 4, 5, 6, 7, 8, 9]) == "[0, 1, 3, 4, 5, 6, 7, ..., 9]"


def test_summary_lists_every_group_kind_and_node_locality():
    """World 16 on nodes of 8, TP2 CP2 PP2 (DP 2) and ETP1 EP4 (EDP 2). Order tp-cp-ep-dp-pp gives
    attention strides tp 1, cp 2, dp 4, pp 8 and expert strides ep 1, edp 4, pp 8; a group stays in
    one node when all its ranks share rank // 8, so only the PP groups (rank r and r + 8) cross."""
    text = FoldingMesh(16, tp=2, cp=2, pp=2, ep=4, etp=1).render_summary(gpus_per_node=8)
    lines = text.splitlines()
    assert lines[0] == "Parallel Folding mesh: world 16 ranks, order tp-cp-ep-dp-pp, 2 nodes x 8 GPUs"
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("mesh"))
    # cells are separated by at least two spaces; labels and rank lists hold single spaces
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[header + 1:]]
    assert rows == [
        ["attention", "tp", "8", "2", "[0, 1]", "yes"],
        ["attention", "cp", "8", "2", "[0, 2]", "yes"],
        ["attention", "dp", "8", "2", "[0, 4]", "yes"],
        ["attention", "dp_cp", "4", "4", "[0, 2, 4, 6]", "yes"],
        ["attention", "pp", "8", "2", "[0, 8]", "no"],
        ["expert", "etp", "16", "1", "[0]", "yes"],
        ["expert", "ep (EP_MP)", "4", "4", "[0, 1, 2, 3]", "yes"],
        ["expert", "edp (EP_DP)", "8", "2", "[0, 4]", "yes"],
    ]



def test_text_table_pads_to_the_widest_cell_or_header_and_aligns_per_column():
    """Column widths are max(header, cells); column 0 is left-aligned (`left`), the others right-aligned,
    cells joined by two spaces and trailing blanks stripped. Expected lines written out by hand."""
    text = text_table(["name", "count"], [["a", "10"], ["bcdef", "7"]], indent="> ", left=(0,))
    assert text.splitlines() == [
        "> name   count",
        "> a         10",
        "> bcdef      7",
    ]


def test_summary_node_locality_needs_every_group_in_one_node_and_shows_expert_edp():
    """World 6, TP3 on nodes of 4: tp groups [0, 1, 2] (node 0) and [3, 4, 5] (nodes 0 and 1), so
    "in one node" is "no" although one group stays in a node. World 8, TP2 (DP4) with ETP1 EP4 (EDP2):
    the per-stage line multiplies ETP*EP*EDP = 1*4*2, not ETP*EP*DP = 16."""
    lines = FoldingMesh(6, tp=3).render_summary(gpus_per_node=4).splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("mesh"))
    tp_row = re.split(r"\s{2,}", lines[header + 1].strip())
    assert tp_row == ["attention", "tp", "2", "3", "[0, 1, 2]", "no"]
    text = FoldingMesh(8, tp=2, ep=4, etp=1).render_summary()
    assert "  per stage  TP*CP*DP = 8 = ETP*EP*EDP = 8 ranks" in text.splitlines()


# ---------------------------------------------------------------- memory


def test_memory_matches_a_hand_computation():
    # world 16: TP2 PP2 EP4 ETP1 -> DP 4, EDP 2 (TP*DP = 8 = EP*EDP); 4 layers (first dense), 2 per stage.
    mesh = FoldingMesh(16, tp=2, pp=2, ep=4, etp=1)
    assert (mesh.dp, mesh.edp) == (4, 2)
    model = ModelShape(layers=4, hidden=64, ffn=256, moe_ffn=32, experts=8, topk=2, vocab=1000, dense_layers=1)
    stages = estimate(model, mesh, Precision("bf16", optimizer="adam", distributed_optimizer=True))

    h = 64
    attention = (3 * h * h + h * h) // 2 + 2 * h  # QKV + proj over TP2, plus two replicated norms
    vocab_padded = 1024  # 1000 rounded up to a multiple of 128 * TP2 = 256
    embedding = vocab_padded * h // 2
    dense_mlp = 3 * h * 256 // 2
    router = 8 * h  # replicated over TP
    experts_here = (8 // 4) * 3 * h * 32  # two local experts of 3 matrices, ETP 1
    stage0_dense = 2 * attention + dense_mlp + router + embedding  # layers 0 (dense) and 1 (MoE)
    stage1_dense = 2 * attention + 2 * router + embedding + h  # layers 2, 3 (MoE), output, final norm
    assert [s.params.dense for s in stages] == [stage0_dense, stage1_dense] == [74_496, 50_496]
    assert [s.params.expert for s in stages] == [experts_here, 2 * experts_here] == [12_288, 24_576]
    assert (stages[0].dense_layers, stages[0].moe_layers, stages[1].moe_layers) == (1, 1, 2)

    s0 = stages[0]
    assert s0.param_bytes.dense == 2 * stage0_dense and s0.grad_bytes.dense == 4 * stage0_dense
    # Adam: 12 B (fp32 master + 2 moments), sharded over DP*CP = 4 (dense) and EDP = 2 (experts)
    assert s0.optimizer_bytes.dense == 12 * stage0_dense // 4
    assert s0.optimizer_bytes.expert == 12 * experts_here // 2
    assert s0.total_bytes == (2 + 4) * (stage0_dense + experts_here) + 3 * stage0_dense + 6 * experts_here
    assert s0.total_bytes == 817_920

    total, active = model.total_and_active_params()
    assert total == 4 * (4 * h * h + 2 * h) + 3 * h * 256 + 3 * (8 * h + 8 * 3 * h * 32) + 2 * 1000 * h + h
    assert total - active == 3 * (8 - 2) * 3 * h * 32


def test_memory_shards_optimizer_states_per_distributed_optimizer_instance():
    """Megatron shards over DP*CP / instances and EDP / instances (each instance keeps a copy); the
    estimate used to divide by DP*CP and EDP whatever the instances (a review)."""
    model = ModelShape(layers=4, hidden=1024, moe_ffn=512, experts=16, topk=2, vocab=32000)
    precision = Precision("bf16", optimizer="adam", distributed_optimizer=True)
    (one,) = estimate(model, FoldingMesh(16, ep=4), precision)
    mesh = FoldingMesh(16, ep=4, dist_opt_instances=4)  # DP*CP 16 -> 4 per instance, EDP 4 -> 1
    (four,) = estimate(model, mesh, precision)
    dense, expert = four.params.dense, four.params.expert
    assert (four.optimizer_bytes.dense, four.optimizer_bytes.expert) == (-(-12 * dense // 4), 12 * expert)
    assert (one.optimizer_bytes.dense, one.optimizer_bytes.expert) == (-(-12 * dense // 16), -(-12 * expert // 4))
    text = render_memory(model, mesh, precision, [four])
    assert "sharded over DP*CP = 4 (dense) and EDP = 1 (experts) per distributed-optimizer instance (4 instances)" \
        in text


def test_memory_without_distributed_optimizer_and_fit_flag():
    mesh = FoldingMesh(8, pp=1, ep=8)
    model = ModelShape(layers=2, hidden=1024, moe_ffn=512, experts=8, topk=2, vocab=512, tie_embeddings=True)
    (stage,) = estimate(model, mesh, Precision("fp32", optimizer="sgd"))
    assert stage.embedding_params == 512 * 1024  # tied, PP = 1: one copy
    assert stage.optimizer_bytes.total == 4 * stage.params.total  # fp32 params: momentum only
    assert stage.grad_bytes.total == 4 * stage.params.total
    half = stage.total_bytes / GIB / 2
    text = render_memory(model, mesh, Precision("fp32", optimizer="sgd"), [stage], gpu_mem_gib=half)
    assert "DOES NOT FIT" in text and "NO, over by" in text


def test_model_on_mesh_divisibility():
    model = ModelShape(layers=6, hidden=64, moe_ffn=32, experts=6, topk=2, vocab=100)
    with pytest.raises(ValueError, match="layers 6 is not divisible by PP\\*VPP = 4"):
        estimate(model, FoldingMesh(8, pp=4), Precision())
    with pytest.raises(ValueError, match="experts 6 is not divisible by EP = 4"):
        estimate(model, FoldingMesh(8, ep=4), Precision())


def test_memory_cases_a_mutation_audit_found_unasserted():
    # tied embeddings under PP > 1: the last stage holds its own copy of the output layer
    model = ModelShape(layers=2, hidden=64, moe_ffn=32, experts=8, topk=2, vocab=1000, tie_embeddings=True)
    first, last = estimate(model, FoldingMesh(8, pp=2), Precision())
    assert first.embedding_params == last.embedding_params == model.padded_vocab(1) * 64
    # fp16 params keep an fp32 master copy too: Adam is 8 B of moments + 4 B of master
    assert Precision("fp16").optimizer_bytes_per_param() == 12 and Precision("fp32").optimizer_bytes_per_param() == 8
    # an all-MoE model has no dense FFN, so its ffn need not divide by TP
    estimate(ModelShape(layers=2, hidden=64, ffn=1001, moe_ffn=32, experts=8, topk=2, vocab=1000),
             FoldingMesh(8, tp=2), Precision())
    # an exact fit fits
    (stage,) = estimate(ModelShape(layers=2, hidden=64, moe_ffn=32, experts=8, topk=2, vocab=1000), FoldingMesh(8),
                        Precision())
    assert fits(stage, stage.total_bytes / GIB) and not fits(stage, stage.total_bytes / GIB * 0.999)


def test_model_shape_sizes_from_their_definitions():
    small = dict(layers=2, hidden=64, moe_ffn=32, experts=8, topk=2, vocab=1000)
    # padded to a multiple of 128 * TP: 1100 -> 5 * 256 under TP2 (not 9 * 128)
    assert ModelShape(**{**small, "vocab": 1100}).padded_vocab(2) == 1280
    assert ModelShape(**{**small, "vocab": 1100}).padded_vocab(1) == 1152
    # GQA: K and V are query_groups * head_dim = 2 * (64 / 8) wide; QKV is h x (h + 2 kv), proj h x h
    gqa = ModelShape(**small, heads=8, query_groups=2)
    assert gqa.kv_width == 16
    assert gqa.attention_params() == 64 * 96 + 64 * 64
    assert ModelShape(**small, heads=8).attention_params() == 64 * 192 + 64 * 64  # MHA
    # tied embeddings drop exactly one vocab x hidden table from the whole-model count
    untied, tied = ModelShape(**small), ModelShape(**small, tie_embeddings=True)
    assert untied.total_and_active_params()[0] - tied.total_and_active_params()[0] == 1000 * 64
    # top-k may equal the number of experts but not exceed it
    ModelShape(**{**small, "experts": 4, "topk": 4})
    with pytest.raises(ValueError, match="topk 5 exceeds the number of experts 4"):
        ModelShape(**{**small, "experts": 4, "topk": 5})


def test_precision_default_grad_dtype():
    # Megatron accumulates bf16 grads in fp32; other dtypes keep their own
    assert Precision("bf16").grad_dtype == "fp32"
    assert Precision("fp16").grad_dtype == "fp16"
    assert Precision("fp32").grad_dtype == "fp32"
    assert Precision("fp16", grad_dtype="fp32").grad_dtype == "fp32"


def test_memory_shards_dense_states_over_dp_times_cp():
    """Dense gradients are replicated over DP x CP, so the distributed optimizer shards dense states
    over DP*CP (8 here), experts' over EDP (4). Counted by hand: world 8, CP2 EP2 -> DP 4, EDP 4."""
    mesh = FoldingMesh(8, cp=2, ep=2)
    model = ModelShape(layers=2, hidden=64, moe_ffn=32, experts=8, topk=2, vocab=1000)
    (stage,) = estimate(model, mesh, Precision("bf16", optimizer="adam", distributed_optimizer=True))
    h = 64
    per_layer = 4 * h * h + 2 * h + 8 * h  # attention, two norms, router
    dense = 2 * per_layer + 2 * 1024 * h + h  # embedding and output layer (1000 -> 1024), final norm
    expert = 2 * (8 // 2) * 3 * h * 32
    assert (stage.params.dense, stage.params.expert) == (dense, expert) == (165_184, 49_152)
    assert stage.optimizer_bytes.dense == -(-12 * dense // 8) == 247_776
    assert stage.optimizer_bytes.expert == 12 * expert // 4 == 147_456


def test_memory_divides_shared_experts_by_tp_and_routed_experts_by_etp():
    base = dict(layers=2, hidden=64, moe_ffn=32, experts=8, topk=2, vocab=1000)
    precision = Precision()
    # a shared expert (3 matrices of 64 x 64) is a dense MLP sharded over TP2, in each of the 2 MoE layers
    mesh = FoldingMesh(8, tp=2)
    (plain,) = estimate(ModelShape(**base), mesh, precision)
    (shared,) = estimate(ModelShape(**base, shared_expert_ffn=64), mesh, precision)
    assert shared.params.dense - plain.params.dense == 2 * 3 * 64 * 64 // 2
    assert shared.params.expert == plain.params.expert
    # routed experts: 8 / EP2 = 4 local experts of 3 x 64 x 32, sharded over ETP2 (TP stays 1)
    (stage,) = estimate(ModelShape(**base), FoldingMesh(8, ep=2, etp=2), precision)
    assert stage.params.expert == 2 * 4 * 3 * 64 * 32 // 2 == 24_576


def test_memory_interleaves_layers_over_virtual_stages():
    """PP2 VPP2, 8 layers: 4 chunks of 2 layers dealt round-robin, so stage 0 holds layers 0, 1, 4, 5
    and stage 1 layers 2, 3, 6, 7; with 3 leading dense layers stage 0 has two of them, stage 1 one."""
    model = ModelShape(layers=8, hidden=64, moe_ffn=32, experts=8, topk=2, vocab=1000, dense_layers=3)
    mesh = FoldingMesh(8, pp=2, vpp=2)
    assert [stage_layers(model, mesh, s) for s in (0, 1)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    stages = estimate(model, mesh, Precision())
    assert [(s.dense_layers, s.moe_layers) for s in stages] == [(2, 2), (1, 3)]


def test_model_on_mesh_needs_moe_ffn_divisible_by_etp():
    model = ModelShape(layers=2, hidden=64, moe_ffn=30, experts=8, topk=2, vocab=1000)
    with pytest.raises(ValueError, match="moe_ffn 30 is not divisible by ETP = 4"):
        estimate(model, FoldingMesh(8, ep=2, etp=4), Precision())
    estimate(model, FoldingMesh(8, ep=2, etp=2), Precision())  # 30 = 2 x 15


def test_group_of_refuses_a_rank_outside_the_world():
    mesh = FoldingMesh(8, tp=2)
    with pytest.raises(ValueError, match="rank 8 is outside the world of 8 ranks"):
        mesh.group_of(8, "tp")
    assert mesh.group_of(7, "tp") == [6, 7]


# ---------------------------------------------------------------- CLI


def run_cli(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "mesh.py"), *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_prints_tables_and_memory():
    result = run_cli("--world", "16", "--tp", "2", "--cp", "2", "--pp", "2", "--ep", "4", "--etp", "1",
                     "--layers", "8", "--hidden", "256", "--moe-ffn", "128", "--experts", "8", "--topk", "2",
                     "--vocab", "1000", "--gpu-mem-gib", "80", "--distributed-optimizer")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "ETP 1 x EP 4 x EDP 2 x PP 2" in out and "PP stage 1 (8 ranks)" in out
    assert "param GiB d/e" in out and "Fits:" in out


def test_cli_big_world_prints_first_stage_only():
    result = run_cli("--nodes", "64", "--gpus-per-node", "8", "--pp", "8", "--ep", "8")
    assert result.returncode == 0, result.stderr
    assert "PP stage 0 (64 ranks)" in result.stdout and "PP stage 1" not in result.stdout
    assert "ep (EP_MP)" in result.stdout


def test_cli_errors_are_argparse_errors():
    result = run_cli("--world", "24", "--pp", "2", "--ep", "8")
    assert result.returncode == 2 and "(world/PP) = 12 is not divisible by ETP*EP = 8" in result.stderr
    result = run_cli("--world", "8", "--layers", "4")
    assert result.returncode == 2 and "model flags missing" in result.stderr
    result = run_cli("--world", "8", "--tp", "0")
    assert result.returncode == 2 and "expected an integer >= 1" in result.stderr
    result = run_cli("--world", "8", "--layers", "4", "--hidden", "64", "--moe-ffn", "8", "--experts", "4",
                     "--topk", "2", "--vocab", "10", "--gpu-mem-gib", "0.000001", "--strict")
    assert result.returncode == 1 and "DOES NOT FIT" in result.stdout
