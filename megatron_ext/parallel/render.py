"""Text rendering of a FoldingMesh: a summary of group kinds and per-stage rank tables.

Pure formatting over the mesh's pure-math groups; used by tools/mesh.py and the docs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_ext.parallel.folding import FoldingMesh


def text_table(headers: list[str], rows: list[list[str]], indent: str = "", left: tuple[int, ...] = ()) -> str:
    """Text table; columns are right-aligned except the indices in `left`."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells):
        return indent + "  ".join(c.ljust(w) if i in left else c.rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join(line(cells).rstrip() for cells in [headers] + rows)


def short_list(ranks: list[int], limit: int = 8) -> str:
    """A rank list, shortened to its ends (and step) past `limit` entries."""
    if len(ranks) <= limit:
        return "[" + ", ".join(map(str, ranks)) + "]"
    step = ranks[1] - ranks[0]
    if all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] (step {step})"
    return "[" + ", ".join(map(str, ranks[:limit - 1])) + f", ..., {ranks[-1]}]"


def render_summary(mesh: FoldingMesh, gpus_per_node: int | None = None) -> str:
    """Sizes, the folding identity, and each group kind: count, size, the group of rank 0,
    and (with gpus_per_node) whether every group stays inside one node."""
    m = mesh
    lines = [
        f"Parallel Folding mesh: world {m.world_size} ranks, order {m.order}"
        + (f", {m.world_size // gpus_per_node} nodes x {gpus_per_node} GPUs" if gpus_per_node else ""),
        f"  attention  TP {m.tp} x CP {m.cp} x DP {m.dp} x PP {m.pp}",
        f"  experts    ETP {m.etp} x EP {m.ep} x EDP {m.edp} x PP {m.pp}",
        f"  per stage  TP*CP*DP = {m.tp * m.cp * m.dp} = ETP*EP*EDP = "
        f"{m.etp * m.ep * m.edp} ranks"
        + (f"; VPP {m.vpp}" if m.vpp else ""),
    ]
    rows = []
    for which, kinds, getter in (("attention", ("tp", "cp", "dp", "dp_cp", "pp"), m.attention_groups),
                                 ("expert", ("etp", "ep", "edp"), m.expert_groups)):
        # expert pp groups are omitted: identical to the attention ones (validated)
        for kind in kinds:
            groups = getter(kind)
            label = {"ep": "ep (EP_MP)", "edp": "edp (EP_DP)"}.get(kind, kind)
            row = [which, label, str(len(groups)), str(len(groups[0])), short_list(groups[0])]
            if gpus_per_node:
                row.append("yes" if all(len({r // gpus_per_node for r in g}) == 1 for g in groups) else "no")
            rows.append(row)
    headers = ["mesh", "group", "count", "size", "group of rank 0"]
    if gpus_per_node:
        headers.append("in one node")
    lines.append(text_table(headers, rows, indent="  ", left=(0, 1, 4)))
    return "\n".join(lines)


def render_rank_tables(mesh: FoldingMesh, stages: list[int] | None = None,
                       gpus_per_node: int | None = None) -> str:
    """The summary, then per pipeline stage each rank's attention coordinates (tp, cp, dp) and
    expert coordinates (etp, ep, edp). `stages` limits the stages shown."""
    stages = list(range(mesh.pp)) if stages is None else stages
    out = [render_summary(mesh, gpus_per_node)]
    for stage in stages:
        ranks = mesh.stage_ranks(stage)
        out.append(f"\nPP stage {stage} ({len(ranks)} ranks)")
        headers = ["rank"] + (["node"] if gpus_per_node else []) + ["tp", "cp", "dp", "|", "etp", "ep", "edp"]
        rows = []
        for rank in ranks:
            a, e = mesh.attention_coordinates(rank), mesh.expert_coordinates(rank)
            node = [str(rank // gpus_per_node)] if gpus_per_node else []
            rows.append([str(rank)] + node + [str(a["tp"]), str(a["cp"]), str(a["dp"]), "|",
                                              str(e["etp"]), str(e["ep"]), str(e["edp"])])
        out.append(text_table(headers, rows, indent="  "))
    return "\n".join(out)
