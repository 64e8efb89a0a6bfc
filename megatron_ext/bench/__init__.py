"""The benchmark library behind tools/ (BENCHMARKS.md): what the tools share, in the package so
that every tool imports one copy and nothing from tests/.

  repo_paths      the checkout's folders the tools read and write (bench/results/, test cases)
  cuda_required   require_cuda: a GPU-only tool's up-front exit (status 2) without a GPU
  measurement     timing of one step (device, host submission), peak memory, the step itself
  flops           useful-token expert FLOPs of a MoE layer
  kernel_profile  top kernels, host ops and host synchronizations of one step (torch.profiler)
  results         result JSON with the environment, under bench/results/
  nvlink_safe_env NVLink multicast off in the environment (multi-GPU tools, set on import)
  ep_distributed, ep_paths, ep_phase_timing, ep_report
                  the EP layer benchmark (tools/bench_ep.py) and the transport benchmark's ranks
  functional      functional-test cases: case files, training a case, its log metrics, the
                  golden-value comparison and a case run (tests/functional_tests/runner.py)
"""
