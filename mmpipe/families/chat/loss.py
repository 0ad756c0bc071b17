"""The next-token loss of chat families: transformers' ``ForCausalLMLoss`` on label tokens (-100
ignored), its token-mean normaliser over the global batch (``Family.token_mean``) and the
evaluation's per-micro-batch sums."""
from __future__ import annotations

import torch
from torch import nn


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """The next-token targets: position t predicts labels[t + 1] (the last position: none)."""
    return nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()


def label_tokens(labels: torch.Tensor) -> int:
    """How many tokens a micro-batch's loss is over."""
    return int((shifted(labels) != -100).sum())


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, normaliser=None) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss``: the mean over label tokens (-100 ignored); with
    ``normaliser`` (a tensor), the sum over label tokens divided by it, as transformers does with
    ``num_items_in_batch``: the trainer passes the global batch's label-token count / (micro-batches
    x data-parallel ranks), so that DeepSpeed's mean over micro-batches and ranks is the token mean."""
    logits = logits.float()
    target = shifted(labels).reshape(-1).to(logits.device)
    flat = logits.reshape(-1, logits.shape[-1])
    if normaliser is None:
        return nn.functional.cross_entropy(flat, target, ignore_index=-100, reduction="mean")
    total = nn.functional.cross_entropy(flat, target, ignore_index=-100, reduction="sum")
    return total / normaliser.to(total.device, total.dtype).reshape(())


def token_stats(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[summed loss, label tokens, correctly predicted tokens] of a micro-batch (evaluation)."""
    target = shifted(labels).to(logits.device)
    keep = target != -100
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1),
                                       ignore_index=-100, reduction="sum")
    right = ((logits.argmax(-1) == target) & keep).sum()
    return torch.stack([loss.double(), keep.sum().double(), right.double()])
