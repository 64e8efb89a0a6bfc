"""The test helpers that run Triton's CPU interpreter (tests/unit/interpreter.py) do what they say."""

from tests.unit.interpreter import run_shards, run_under_interpreter, shard


def test_interpreter_patches_keep_every_launch_patched_and_round_bf16_as_a_gpu():
    out = run_under_interpreter("_interpreter_patch_interp.py")
    assert "ok nested helpers patched once per launch" in out and "ok launches after a jit call" in out, out
    assert "ok bf16 cast rounds as torch does" in out, out


def test_shards_split_the_cases_without_overlap_or_gaps():
    cases = [f"case{i}" for i in range(7)]
    parts = [shard(cases, f"{k}/3") for k in range(3)]
    assert sorted(sum(parts, [])) == sorted(cases) and all(parts)
    assert shard(cases, None) == cases


def test_a_failing_shard_fails_the_run():
    """Each shard of the route-ordering script with a dropped barrier: some case fails, so the run does."""
    returncode, out = run_shards("_symm_ordering_interp.py", "--drop-barrier", "dispatch", "--case",
                                 "cf1.0_one_mb_late_rank0", "--case", "cf1.25_one_mb_poison_random")
    assert returncode != 0 and "FAIL cf1.0_one_mb_late_rank0" in out, out
