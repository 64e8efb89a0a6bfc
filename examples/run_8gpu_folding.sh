#!/usr/bin/env bash
# GPT-MoE on 8 GPUs of one host with Parallel Folding: attention runs TP2 (sequence parallel) x DP4,
# experts run EP8 x ETP1 over the same 8 ranks; megatron_ext's rowwise dispatcher moves token rows
# over the EP8 group with the symmetric-memory transport. Mock data, 100 steps.
#
#   bash examples/run_8gpu_folding.sh                  # from the repository root
#   bash examples/run_8gpu_folding.sh --train-iters 20 # extra flags are appended (later flags win)
#   PRINT_ONLY=1 bash examples/run_8gpu_folding.sh     # print the command, do not run it
#
# Folding rule (per pipeline stage): TP x CP x DP = ETP x EP x EDP = GPUs; here 2x1x4 = 1x8x1 = 8.
# Experts must not be tensor-parallel with the rowwise layer (--expert-tensor-parallel-size 1).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
export CUDA_DEVICE_MAX_CONNECTIONS=1

MODEL=(
  --num-layers 4 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 4096
  --seq-length 2048 --max-position-embeddings 2048
  --swiglu --disable-bias-linear --normalization RMSNorm --position-embedding-type rope
  --untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0
  --transformer-impl local --no-persist-layer-norm --no-masked-softmax-fusion --no-rope-fusion --no-gradient-accumulation-fusion
)
FOLDING=(
  --tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 1
  --pipeline-model-parallel-size 1
  --expert-model-parallel-size 8 --expert-tensor-parallel-size 1
)
MOE=(
  --num-experts 64 --moe-router-topk 8 --moe-ffn-hidden-size 512
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-router-dtype fp32
  --moe-token-dispatcher-type alltoall
)
MOE_EXT=(
  --moe-ext-dispatcher rowwise --moe-ext-transport symm --moe-ext-capacity-factor 1.25
  --moe-ext-metrics-interval 25
)
TRAINING=(
  --micro-batch-size 2 --global-batch-size 32 --train-iters 100 --bf16
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 --init-method-std 0.02 --seed 1234
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --eval-iters 0 --eval-interval 1000
  --log-interval 1 --log-num-zeros-in-grad
)
COMMAND=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 8
         -m megatron_ext.launch examples/pretrain_gpt.py
         "${MODEL[@]}" "${FOLDING[@]}" "${MOE[@]}" "${MOE_EXT[@]}" "${TRAINING[@]}" "$@")
if [ -n "${PRINT_ONLY:-}" ]; then
  printf '%q ' "${COMMAND[@]}"; echo
  exit 0
fi
exec "${COMMAND[@]}"
