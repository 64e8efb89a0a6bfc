timeout 230 python3 -m pytest -q tests/gpu 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | head -8
for i in 1 2 3; do
  CUDA_MODULE_LOADING=EAGER timeout 120 python3 -m pytest -q -x tests/gpu/test_activation_recompute_gpu.py tests/gpu/test_ddp_megatron_gpu.py tests/gpu/test_dropless_arena_gpu.py tests/gpu/test_experts_gpu.py tests/gpu/test_expert_variants_gpu.py tests/gpu/test_fused_router_gpu.py tests/gpu/test_graph_runner_gpu.py 2>&1 | grep -E "^E .*capture|passed|failed" | head -3 | sed "s/^/EAGER run $i: /"
done
