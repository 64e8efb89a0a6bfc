"""tools/dropless_memory_probe.py: bounded-dropless buffers against the rows that arrive (issue 20)."""

import json

from tools.dropless_memory_probe import main


def test_probe_reports_the_bound_against_arrived_rows(tmp_path, capsys):
    assert main(["--ep", "2", "--steps", "3", "--results-dir", str(tmp_path)]) == 0
    row = json.loads(next(tmp_path.glob("dropless_memory_*.json")).read_text())["result"]["rows"][0]
    assert row["ep"] == 2 and row["layers"] == 4 and row["overflow"] is None
    assert row["arrived_rows_total"] <= row["bounded_rows_total"] < row["worst_case_rows_total"]
    assert row["worst_case_rows_per_layer"] == 2 * row["tokens_per_rank"] * row["topk"]
    # One budget over all layers never needs more than a bound per layer, and both need >= 1 (the
    # busiest rank gets at least the mean); the per-layer factor covers every layer's arrivals.
    assert 1.0 <= row["factor_needed_one_budget_for_all_layers"] <= row["factor_needed_per_layer_bound"]
    balanced = row["tokens_per_rank"] * row["topk"]
    assert max(row["arrived_rows_busiest_rank_per_layer"]) <= row["factor_needed_per_layer_bound"] * balanced
    # Regions and spill hold every layer's rows too, so they never need less than one shared budget.
    best = row["region_spill_best"]
    assert best["fits"] and best["total_factor"] >= row["factor_needed_one_budget_for_all_layers"] - 1e-9
    # The same training with the dropless arena at the budget those demands needed: nothing
    # overflowed, and it held no fewer rows than all layers received at once (and less than a bound per layer).
    run = row["arena_run"]
    assert run["overflow"] is None and run["region_factor"] == row["arena_as_built_best"]["region_factor"]
    assert 1.0 <= run["arena_over_arrived"] <= run["per_layer_bound_needed_over_arrived_at_once"]
    assert run["arena_rows"] >= run["arrived_rows_all_layers_at_once"]
    assert "EP2: 4 MoE layers" in capsys.readouterr().out
