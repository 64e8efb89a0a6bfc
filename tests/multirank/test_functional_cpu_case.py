"""The tiny CPU functional case, end to end through the runner (what CI runs): train 10 steps on
2 gloo ranks, read Megatron-format log lines, compare with the golden values (exact + rtol 0.05)."""

import json
import os

from megatron_ext.bench.functional import case_run, compare
from megatron_ext.bench.functional.case_config import FunctionalCase

CASE = "gpt/tiny_moe_rowwise_cpu_ep2"


def test_cpu_case_matches_its_golden_values(tmp_path):
    outcome = case_run.run_case(CASE, str(tmp_path))
    assert outcome.code == case_run.PASSED, outcome.report()
    tests = {r.test for r in outcome.results}
    assert "deterministic" in tests, "the CPU case must run the exact check"

    # The same run against perturbed golden values must fail (the comparison can fail).
    with open(os.path.join(str(tmp_path), "values_1st.json")) as handle:
        actual = json.load(handle)
    golden = FunctionalCase.load(CASE).load_golden("cpu")
    perturbed = {"lm loss": compare.to_golden_format(
        {step: value * 1.06 for step, value in compare.values_by_step(golden["lm loss"]).items()})}
    results = compare.compare_metrics(perturbed, actual, ["lm loss"], allow_nondeterministic=False)
    assert {r.test for r in results if not r.passed} == {"deterministic", "approximate (rtol 0.05)"}
