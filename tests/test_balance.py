"""Stage balancing: the schedule simulator, cost-based placements, frozen towers costed forward-only."""
from __future__ import annotations

import itertools
import random

import pytest

from mmpipe.pipeline.simulate import bubble_formula, recommend_micro_batches, simulate


@pytest.mark.parametrize("P,M", [(2, 1), (2, 8), (3, 5), (4, 8), (4, 16)])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_equal_stages_give_the_textbook_bubble(P, M, schedule):
    r = simulate([1.0] * P, [2.0] * P, M, schedule=schedule)
    assert r.step_time == pytest.approx(3.0 * (M + P - 1))
    assert r.bubble == pytest.approx(bubble_formula(P, M))
    assert all(i == pytest.approx(bubble_formula(P, M)) for i in r.idle_frac)


def test_the_slowest_stage_sets_the_pace():
    # stage 1 three times slower: M x (F1 + B1) plus stage 0's fill and drain
    r = simulate([1.0, 3.0], [2.0, 6.0], 8)
    assert r.step_time == pytest.approx(8 * 9 + 3)
    assert r.idle_frac[1] == pytest.approx(3 / 75) and r.idle_frac[0] == pytest.approx(1 - 24 / 75)


def test_transfers_and_optimizer_add_to_the_step():
    base = simulate([1.0] * 2, [2.0] * 2, 4).step_time
    assert simulate([1.0] * 2, [2.0] * 2, 4, comm=[0.5]).step_time > base
    assert simulate([1.0] * 2, [2.0] * 2, 4, opt=[1.5, 0.0]).step_time == pytest.approx(base + 1.5)
    # the last stage's optimizer step overlaps stage 0's last backward (2.0): hidden up to that
    assert simulate([1.0] * 2, [2.0] * 2, 4, opt=[0.0, 1.5]).step_time == pytest.approx(base)
    assert simulate([1.0] * 2, [2.0] * 2, 4, opt=[0.0, 2.5]).step_time == pytest.approx(base + 0.5)


def test_micro_batch_recommendation_and_its_limit():
    rec = recommend_micro_batches([1.0, 1.0], [2.0, 2.0], [0.0], [0.0, 0.0], per_rank_batch=64, target_bubble=0.1)
    assert rec["best"]["micro_batches"] == 16  # (P-1)/(M+P-1) <= 0.1 first at M = 9 -> next divisor 16
    assert rec["best"]["bubble"] <= 0.1
    rec = recommend_micro_batches([1.0, 1.0], [2.0, 2.0], [0.0], [0.0, 0.0], per_rank_batch=4, target_bubble=0.1)
    assert rec["best"] is None and "at most 4 micro-batches" in rec["why"]
    rec = recommend_micro_batches([1.0, 3.0], [2.0, 6.0], [0.0], [0.0, 0.0], per_rank_batch=64, target_bubble=0.1)
    assert rec["best"] is None and "unbalanced" in rec["why"]
