"""Run one functional test case: train, extract the metrics from the log, compare with golden values.

    python tests/functional_tests/runner.py --list
    python tests/functional_tests/runner.py --case gpt/tiny_moe_rowwise_cpu_ep2
    python tests/functional_tests/runner.py --case gpt/moe_rowwise_1gpu --generate   # write golden values

What a case run does (TEST_TYPE regular and ckpt-resume) and its exit codes (0 passed, 1 a check
failed, 2 no golden values yet, 3 skipped, 4 training failed): megatron_ext/bench/functional/case_run.py.
Outputs (logs, actual values as JSON) go to --output-dir (default: a new temporary folder).

The command line over megatron_ext.bench.functional (case files, training, log metrics, the
comparison, the case run); the cases stay here, under test_cases/.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_ext.bench.functional.case_config import list_cases
from megatron_ext.bench.functional.case_run import run_case


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", help="<model>/<name> under tests/functional_tests/test_cases")
    parser.add_argument("--list", action="store_true", help="list the cases")
    parser.add_argument("--generate", action="store_true", help="write the golden values from this run")
    parser.add_argument("--output-dir", help="logs and actual values (default: a new temporary folder)")
    parser.add_argument("--data-path", help="fills ${DATA_PATH} (default: the DATA_PATH environment variable)")
    options = parser.parse_args(argv)
    if options.list:
        print("\n".join(list_cases()))
        return 0
    known = list_cases()
    if not options.case:
        parser.error(f"give --case <model>/<name> (or --list); known cases: {', '.join(known)}")
    if options.output_dir and os.path.exists(options.output_dir) and not os.path.isdir(options.output_dir):
        parser.error(f"--output-dir {options.output_dir} is a file; give a folder")
    if options.case not in known:  # a usage error: one line, no traceback
        parser.error(f"no test case {options.case!r}; known cases: {', '.join(known)} (--list)")
    outcome = run_case(options.case, options.output_dir, options.generate, options.data_path)
    print(outcome.report(), flush=True)
    return outcome.code


if __name__ == "__main__":
    sys.exit(main())
