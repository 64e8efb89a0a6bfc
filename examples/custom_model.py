"""A custom Megatron-Core model whose MoE layers come from megatron_ext by swapping its spec.

The model is not a GPTModel: a token classifier (embedding -> TransformerBlock -> mean pool ->
linear head) whose block spec is written by hand: a dense layer, then a MoE layer, then a dense
layer again (Megatron's local layer specs). `megatron_ext.specs.swap_moe_parts` returns a copy of
that spec tree with the MoE layer's MLP slot replaced by megatron_ext's RowwiseMoELayer, grouped
experts and FusedTopKRouter (Megatron's TopKRouter with the same parameters, its routing fused on
GPUs); the dense layers and everything else stay Megatron's.

Runs on CPU ranks (gloo, forked) with the reference row transport, EP = number of ranks:

    python examples/custom_model.py [--ranks 2] [--dispatcher rowwise|megatron]

It builds the model on every rank, runs one forward and backward on synthetic tokens, and
prints the loss and where the gradients landed. On GPUs the same spec swap works unchanged
(transport "auto" picks the symmetric-memory transport there).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.quiet import quiet_known_warnings  # noqa: E402

quiet_known_warnings()  # before Megatron is imported
import torch  # noqa: E402

from megatron_ext._cpu import apply_cpu_shims  # noqa: E402

apply_cpu_shims()

from megatron_ext.config import MoEExtConfig  # noqa: E402
from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks  # noqa: E402

HIDDEN, HEADS, EXPERTS, TOPK, VOCAB, CLASSES, SEQ, BATCH = 64, 4, 4, 2, 100, 3, 16, 4


def custom_block_spec():
    """The hand-written spec tree: dense, MoE, dense (Megatron's local layer specs)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    dense = get_gpt_layer_local_spec(normalization="RMSNorm")
    moe = get_gpt_layer_local_spec(num_experts=EXPERTS, normalization="RMSNorm")
    return TransformerBlockSubmodules(layer_specs=[dense, moe, dense], layer_norm=WrappedTorchNorm)


def transformer_config(ep: int):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=3, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=2 * HIDDEN,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=HIDDEN,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2, expert_model_parallel_size=ep,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False)


class TokenClassifier(torch.nn.Module):
    """Embedding -> Megatron TransformerBlock (custom spec) -> mean over tokens -> class logits."""

    def __init__(self, config, block_spec):
        from megatron.core.transformer.transformer_block import TransformerBlock

        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, config.hidden_size)
        self.block = TransformerBlock(config, block_spec)
        self.head = torch.nn.Linear(config.hidden_size, CLASSES)

    def forward(self, tokens):  # tokens [batch, seq]
        hidden = self.embedding(tokens).transpose(0, 1).contiguous()  # [seq, batch, hidden]
        causal = torch.triu(torch.ones(1, 1, tokens.shape[1], tokens.shape[1], dtype=torch.bool), diagonal=1)
        hidden = self.block(hidden, attention_mask=causal)
        return self.head(hidden.mean(dim=0))


def build_and_step(rank: int, world: int, ext_config: MoEExtConfig) -> dict:
    """Build the swapped model on this rank, one forward/backward; returns what to print."""
    from megatron.core import parallel_state

    from megatron_ext.specs import swap_moe_parts

    config = transformer_config(parallel_state.get_expert_model_parallel_world_size())
    spec = swap_moe_parts(custom_block_spec(), ext_config)
    torch.manual_seed(1234)  # same dense weights on every rank (experts are per rank anyway)
    model = TokenClassifier(config, spec)
    generator = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    loss = torch.nn.functional.cross_entropy(model(tokens), labels)
    loss.backward()
    mlp_types = [type(layer.mlp).__name__ for layer in model.block.layers]
    expert_grad = sum(p.grad.norm().item() for n, p in model.named_parameters()
                      if "experts" in n and p.grad is not None)
    return {"rank": rank, "loss": loss.item(), "mlp_per_layer": mlp_types, "expert_grad_norm": expert_grad}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks (gloo); EP equals this")
    parser.add_argument("--dispatcher", choices=("rowwise", "megatron"), default="rowwise")
    args = parser.parse_args(argv)
    if args.ranks < 1 or EXPERTS % args.ranks:
        divisors = ", ".join(str(n) for n in range(1, EXPERTS + 1) if EXPERTS % n == 0)
        parser.error(f"--ranks must divide the model's {EXPERTS} experts (EP equals --ranks), got {args.ranks}; "
                     f"use one of {divisors}")
    ext_config = MoEExtConfig(dispatcher=args.dispatcher, transport="torch" if args.dispatcher == "rowwise" else "auto")
    results = run_on_ranks(build_and_step, args.ranks, ext_config, sizes=ParallelSizes(ep=args.ranks), timeout=300)
    print(f"custom model, {args.ranks} CPU ranks, EP={args.ranks}, megatron_ext dispatcher={args.dispatcher}")
    print(f"layers' MLPs: {results[0]['mlp_per_layer']}")
    for result in results:
        print(f"rank {result['rank']}: loss {result['loss']:.4f} | "
              f"expert gradient norm {result['expert_grad_norm']:.4f}")
    return results


if __name__ == "__main__":
    main()
