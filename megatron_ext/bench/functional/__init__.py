"""Functional tests in Megatron-LM's layout, as a library: the cases themselves and their CLI
stay in tests/functional_tests/ (test_cases/, runner.py); the tools that train variants of a
case (tools/bench_training.py, tools/mxfp8_loss_curve.py) use the same pieces.

  case_config  model_config.yaml reader (no PyYAML needed), case settings, golden-value paths
  training     a case's command, environment and run; the metrics of a trained variant
  log_metrics  per-step metrics from Megatron's log lines (also printed by the CPU job)
  compare      golden-value format and Megatron's tolerances (time and memory: regressions only)
  case_run     one case end to end, with the runner's exit codes
"""
