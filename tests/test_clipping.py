"""Grouped clipping units: fp32 norms of fp16 gradients, which skipped steps count as bad."""
from __future__ import annotations

import math

import torch


def test_group_norms_of_fp16_gradients_are_taken_in_fp32():
    """A loss-scaled fp16 gradient whose norm passes 65504 with every element finite is not an overflow."""
    from mmpipe.train.clipping import sum_of_squares
    g = torch.full((10_000,), 1000.0, dtype=torch.float16)
    assert not torch.isfinite(torch._foreach_norm([g], 2.0)[0])  # what an fp16 norm gives
    assert math.isclose(float(sum_of_squares([g, g.bfloat16()])), 2 * 10_000 * 1000.0 ** 2, rel_tol=1e-4)
    assert not math.isfinite(float(sum_of_squares([torch.tensor([float("inf")], dtype=torch.float16)])))


def test_an_fp16_overflow_that_lowers_the_loss_scale_is_not_a_bad_step():
    from mmpipe.train.faults import counts_as_bad
    assert not counts_as_bad({"skipped": False}, None)
    assert counts_as_bad({"skipped": True}, None)  # fp32 / bf16: a non-finite gradient
    assert not counts_as_bad({"skipped": True, "loss_scale": 32768.0}, 65536.0)  # the scaler calibrating
    assert counts_as_bad({"skipped": True, "loss_scale": 1.0}, 1.0)  # at its floor: the run is broken
