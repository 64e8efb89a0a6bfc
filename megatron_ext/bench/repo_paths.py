"""Folders of the checkout that the benchmark library reads and writes, found from this file.

The package lives at <repo>/megatron_ext (an editable install, or the repository root on
PYTHONPATH as on the GPU machines), so the repository root is two folders above this package.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "bench" / "results"  # benchmark result JSON (results.write_result)
FUNCTIONAL_CASES_DIR = REPO_ROOT / "tests" / "functional_tests" / "test_cases"  # <model>/<name>/model_config.yaml
