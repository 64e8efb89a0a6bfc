"""arena_sizing against hand-worked demand records."""

import torch

from megatron_ext.bench.arena_sizing import best_region_spill, one_budget, per_layer_bound, region_spill, shared_area

# 2 steps, 3 layers, 2 ranks; balanced = 100 rows per layer
ASKED = torch.tensor([[[120, 80], [90, 110], [100, 100]],
                      [[100, 100], [130, 70], [80, 125]]])


def test_per_layer_bound_and_one_budget():
    assert per_layer_bound(ASKED, 100) == 1.30
    # sums over layers per (step, rank): 310, 290, 310, 295 -> 310 / 300
    assert abs(one_budget(ASKED, 100) - 310 / 300) < 1e-12


def test_region_spill_by_hand():
    plan = region_spill(ASKED, 100, 1.0)
    # run-on past 100 rows: layers 0..1 spill (step 0: rank 0 20, rank 1 10; step 1: rank 0 30), the
    # last layer's run-on stays in the tail (step 1, rank 1: 25)
    assert plan.spill_arena_factor == 0.30 and plan.tail_factor == 0.25
    assert abs(plan.total_factor - (300 + 30 + 25) / 300) < 1e-12
    assert abs(plan.copied_fraction - 60 / float(ASKED.sum())) < 1e-12
    assert plan.fits
    assert not region_spill(ASKED, 100, 0.6).fits  # 130 rows run on past 60 by 70 > 60


def test_best_region_is_the_cheapest_that_fits():
    best = best_region_spill(ASKED, 100, factors=[0.6, 0.9, 1.0, 1.3])
    candidates = [region_spill(ASKED, 100, f) for f in (0.9, 1.0, 1.3)]
    assert best.total_factor == min(c.total_factor for c in candidates)
    assert best.region_factor != 0.6


def test_shared_area_as_built_by_hand():
    plan = shared_area(ASKED, 100, 1.0)
    # run-ons per (step, rank) summed over all 3 layers: step 0: rank 0 20, rank 1 10; step 1: rank 0 30,
    # rank 1 25 -> the shared area needs 30 rows (spills and the last layer's run-on share it)
    assert plan.spill_arena_factor == 0.30 and plan.tail_factor == 0.0
    assert abs(plan.total_factor - (300 + 30) / 300) < 1e-12
    assert abs(plan.copied_fraction - 60 / float(ASKED.sum())) < 1e-12  # the last layer's run-on stays put
    assert plan.fits and not shared_area(ASKED, 100, 0.6).fits
    assert best_region_spill(ASKED, 100, factors=[0.9, 1.0], scheme=shared_area).total_factor == min(
        shared_area(ASKED, 100, f).total_factor for f in (0.9, 1.0))
