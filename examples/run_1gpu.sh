#!/usr/bin/env bash
# Small GPT-MoE on one GPU with megatron_ext: rowwise dispatcher, grouped-GEMM experts, symmetric-
# memory row transport (EP=1), Megatron's mock data, 100 steps, through megatron.training.
#
#   bash examples/run_1gpu.sh                       # from the repository root
#   bash examples/run_1gpu.sh --train-iters 200     # extra flags are appended (later flags win)
#   PRINT_ONLY=1 bash examples/run_1gpu.sh          # print the command, do not run it
#
# Real data: add --data-path <prefix> --tokenizer-type HuggingFaceTokenizer --tokenizer-model <name>.
# No Transformer Engine or Apex is assumed (local layers; fused softmax/RoPE/wgrad accumulation off).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
export CUDA_DEVICE_MAX_CONNECTIONS=1

MODEL=(
  --num-layers 4 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 4096
  --seq-length 1024 --max-position-embeddings 1024
  --swiglu --disable-bias-linear --normalization RMSNorm --position-embedding-type rope
  --untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0
  --transformer-impl local --no-persist-layer-norm --no-masked-softmax-fusion --no-rope-fusion --no-gradient-accumulation-fusion
)
MOE=(
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 2048
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-router-dtype fp32
  --moe-token-dispatcher-type alltoall --expert-model-parallel-size 1 --expert-tensor-parallel-size 1
)
MOE_EXT=(
  --moe-ext-dispatcher rowwise --moe-ext-transport symm --moe-ext-capacity-factor 1.25
  --moe-ext-metrics-interval 25
)
TRAINING=(
  --micro-batch-size 4 --global-batch-size 32 --train-iters 100 --bf16
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 --init-method-std 0.02 --seed 1234
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --eval-iters 0 --eval-interval 1000
  --log-interval 1 --log-num-zeros-in-grad
)
COMMAND=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1
         -m megatron_ext.launch examples/pretrain_gpt.py
         "${MODEL[@]}" "${MOE[@]}" "${MOE_EXT[@]}" "${TRAINING[@]}" "$@")
if [ -n "${PRINT_ONLY:-}" ]; then
  printf '%q ' "${COMMAND[@]}"; echo
  exit 0
fi
exec "${COMMAND[@]}"
