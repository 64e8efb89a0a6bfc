"""tiny_gpt's training loop against hand-known facts: the data's labels are the successors of its
tokens, the first logged loss is the mean cross-entropy of a fresh model (about ln(vocab)), and the
attention mask it trains under is causal. test_tiny_gpt_training only checks that the loss falls,
which labels equal to the inputs, an unaveraged loss or a model that sees the future all pass."""

import math

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from megatron_ext import tiny_gpt
from megatron_ext.config import MoEExtConfig
from megatron_ext.cpu_ranks import ParallelSizes, run_on_ranks
from megatron_ext.tiny_gpt import TinyGPTConfig, synthetic_batch


def test_synthetic_labels_are_the_successors_of_the_tokens():
    cfg = TinyGPTConfig()
    successor = {}
    for step in range(3):
        for rank in range(2):
            tokens, labels = synthetic_batch(cfg, step, rank)
            assert tokens.shape == labels.shape == (cfg.micro_batch, cfg.seq_len)
            assert torch.equal(labels[:, :-1], tokens[:, 1:]), "labels are not the next tokens"
            for t, n in zip(tokens.flatten().tolist(), labels.flatten().tolist()):
                assert successor.setdefault(t, n) == n, f"token {t} has two successors"
    assert any(t != n for t, n in successor.items()), "every label equals its token"


def _first_step_rank(rank, world, cfg):
    seen = {}
    build = tiny_gpt.build_model

    def build_and_keep(*args, **kwargs):
        model = build(*args, **kwargs)
        def keep_mask(module, args):  # the mask of the training step (returns None: args unchanged)
            seen.setdefault("mask", args[2])

        model.register_forward_pre_hook(keep_mask)
        seen["model"] = model
        return model

    tiny_gpt.build_model = build_and_keep  # in this forked rank only
    records = tiny_gpt.train(rank, world, cfg, MoEExtConfig(transport="torch"), 1)
    model, mask = seen["model"], seen["mask"]
    tokens, _ = synthetic_batch(cfg, 5, rank)
    changed = tokens.clone()
    half = cfg.seq_len // 2
    changed[:, half:] = (changed[:, half:] + 1) % cfg.vocab
    position_ids = torch.arange(cfg.seq_len)[None].expand(cfg.micro_batch, -1)
    with torch.no_grad():
        a, b = (model(t, position_ids, mask) for t in (tokens, changed))
    return records[0]["loss"], (a[:, :half] - b[:, :half]).abs().max().item(), \
        (a[:, half:] - b[:, half:]).abs().max().item()


def test_first_loss_is_a_fresh_models_and_attention_is_causal():
    cfg = TinyGPTConfig(layers=1, seq_len=16)
    results = run_on_ranks(_first_step_rank, 2, cfg, sizes=ParallelSizes(ep=2))
    for rank, (loss, past, future) in enumerate(results):
        # A fresh model's logits are near zero: the mean loss over ranks is about ln(vocab).
        assert abs(loss - math.log(cfg.vocab)) < 0.3, f"rank {rank}: first loss {loss:.3f} vs ln(V)"
        assert future > 0, f"rank {rank}: changed tokens changed no logits"
        assert past < 1e-5, f"rank {rank}: logits before position {cfg.seq_len // 2} saw later tokens ({past:.2e})"


def _repeated_step_grads_rank(rank, world, cfg):
    grads = []

    def record(optimizer, args, kwargs):
        grads.append([p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]
                      if p.grad is not None])

    batch = tiny_gpt.synthetic_batch
    tiny_gpt.synthetic_batch = lambda cfg, step, rank: batch(cfg, 0, rank)  # in this forked rank only
    handle = register_optimizer_step_pre_hook(record)
    try:
        tiny_gpt.train(rank, world, cfg, MoEExtConfig(transport="torch"), 2)
    finally:
        handle.remove()
    return grads


def test_each_step_uses_only_its_own_gradients():
    """lr=0 and the same batch every step: the parameters never move, so step 2's gradients must equal
    step 1's (a loop that kept the old gradients would show twice them)."""
    cfg = TinyGPTConfig(layers=1, seq_len=16, lr=0.0)
    for rank, (first, second) in enumerate(run_on_ranks(_repeated_step_grads_rank, 2, cfg,
                                                        sizes=ParallelSizes(ep=2))):
        assert len(first) == len(second) > 0
        assert any(torch.count_nonzero(g) for g in first), f"rank {rank}: no gradient at all"
        for i, (a, b) in enumerate(zip(first, second)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=lambda m: f"rank {rank} param {i}: {m}")
