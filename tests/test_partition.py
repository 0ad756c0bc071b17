"""The stage partitioners against brute force: min-max and modality partitions over k segments."""
from __future__ import annotations

import itertools
import random

import pytest


# ---- partitioner -------------------------------------------------------------------------------
def _brute(costs, P, mem=None, cap=None):
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), P - 1):
        parts = [0, *cuts, n]
        segs = [(sum(costs[a:b]), sum((mem or [0] * n)[a:b])) for a, b in zip(parts, parts[1:])]
        if cap is not None and any(m > cap for _, m in segs):
            continue
        v = max(s for s, _ in segs)
        best = v if best is None else min(best, v)
    return best


@pytest.mark.parametrize("seed", range(25))
def test_min_max_partition_is_optimal(seed):
    from mmpipe.planning.partition import bottleneck, min_max_partition
    rng = random.Random(seed)
    n, P = rng.randint(3, 9), rng.randint(1, 4)
    if P > n:
        P = n
    costs = [rng.uniform(0.1, 10) for _ in range(n)]
    mem = [rng.uniform(0, 5) for _ in range(n)]
    cap = rng.choice([None, 8.0, 12.0])
    expect = _brute(costs, P, mem, cap)
    if expect is None:
        with pytest.raises(ValueError):
            min_max_partition(costs, P, memory=mem, memory_cap=cap)
        return
    parts = min_max_partition(costs, P, memory=mem, memory_cap=cap)
    assert parts[0] == 0 and parts[-1] == n and len(parts) == P + 1
    assert all(a < b for a, b in zip(parts, parts[1:]))
    assert bottleneck(costs, parts) == pytest.approx(expect)
    if cap is not None:
        assert all(sum(mem[a:b]) <= cap for a, b in zip(parts, parts[1:]))


@pytest.mark.parametrize("P", [2, 3, 4])
def test_modality_partition_never_mixes(P):
    from mmpipe.planning.partition import modality_partition
    costs = [5, 3, 3, 3, 3, 1, 1, 1, 1, 1]
    branches = ["image"] * 5 + ["text"] * 5
    parts = modality_partition(costs, branches, P)
    for a, b in zip(parts, parts[1:]):
        assert len(set(branches[a:b])) == 1
    # the costlier image branch gets at least as many stages as the text branch
    image_stages = sum(1 for a in parts[:-1] if branches[a] == "image")
    assert image_stages >= P - image_stages


def _brute_force_segmented(costs, segments, P, no_cut=()):
    """Every split of the layers into P contiguous stages that never mixes segments (nor cuts before a
    layer of ``no_cut``): the best bottleneck."""
    import itertools
    n, best = len(costs), None
    for cut in itertools.combinations([i for i in range(1, n) if i not in no_cut], P - 1):
        parts = [0, *cut, n]
        if any(len(set(segments[a:b])) > 1 for a, b in zip(parts, parts[1:])):
            continue
        worst = max(sum(costs[a:b]) for a, b in zip(parts, parts[1:]))
        best = worst if best is None else min(best, worst)
    return best


def _joined(segments):
    """Segment labels with a one-layer segment taken into the one before it (a VLM's projector goes
    with the vision tower)."""
    out = list(segments)
    for i, tag in enumerate(segments):
        alone = (i == 0 or segments[i - 1] != tag) and (i + 1 == len(segments) or segments[i + 1] != tag)
        if alone and i > 0:
            out[i] = out[i - 1]
    return out


@pytest.mark.parametrize("seed", range(8))
def test_modality_partition_with_k_segments_is_exact(seed):
    """vision | projector | llm (a VLM's segments): stages never mix segments, each gets at least
    one, a one-layer segment (the projector) stays with the vision tower, and the slowest stage is
    as fast as the best of all such splits (brute force)."""
    import random

    from mmpipe.planning.partition import bottleneck, modality_partition
    rng = random.Random(seed)
    sizes = [rng.randint(1, 4), rng.randint(1, 2), rng.randint(2, 5)]
    segments = [t for t, k in zip(("vision", "projector", "llm"), sizes) for _ in range(k)]
    joined = _joined(segments)
    costs = [rng.randint(1, 9) for _ in segments]
    for P in range(len(set(joined)), len(costs) + (0 if sizes[1] == 1 else 1)):
        parts = modality_partition(costs, segments, P)
        assert len(parts) == P + 1 and all(a < b for a, b in zip(parts, parts[1:]))
        assert all(len(set(joined[a:b])) == 1 for a, b in zip(parts, parts[1:]))
        # a one-layer projector is never a stage of its own: no cut right before it
        no_cut = {sizes[0]} if sizes[1] == 1 else set()
        assert not no_cut & set(parts)
        assert bottleneck(costs, parts) == _brute_force_segmented(costs, joined, P, no_cut)
    # fewer stages than segments: stages hold whole segments (no boundary inside one), the best
    # such split: vision | projector + llm or vision + projector | llm, whichever is faster
    parts = modality_partition(costs, segments, 2)
    starts = {0, sizes[0], sizes[0] + sizes[1], len(costs)}
    assert set(parts) <= starts and len(parts) == 3
    cuts = (sizes[0] + 1,) if sizes[1] == 1 else (sizes[0], sizes[0] + sizes[1])
    best = min(bottleneck(costs, [0, b, len(costs)]) for b in cuts)
    assert bottleneck(costs, parts) == best
    with pytest.raises(ValueError, match="contiguous"):
        modality_partition([1, 1, 1], ["vision", "llm", "vision"], 2)


def test_the_vlm_projector_stays_with_the_vision_tower():
    """LLaVA-1.5-7B's shape at PP4: 24 ViT blocks + embed, one projector, 34 decoder layers; the
    projector shares the last vision stage, never a stage alone."""
    from mmpipe.planning.partition import modality_partition
    segments = ["vision"] * 25 + ["projector"] + ["llm"] * 34
    costs = [1.0] * 25 + [0.05] + [3.0] * 34
    for P in (3, 4, 8):
        parts = modality_partition(costs, segments, P)
        stage_of_projector = next(k for k, (a, b) in enumerate(zip(parts, parts[1:])) if a <= 25 < b)
        a, b = parts[stage_of_projector], parts[stage_of_projector + 1]
        assert b - a > 1 and set(segments[a:b]) == {"vision", "projector"}, parts


def test_modality_partition_divides_stages_by_cost():
    from mmpipe.planning.partition import modality_partition
    costs = [3] * 4 + [1] + [3] * 6  # vision 12, projector 1, llm 18 over 5 stages
    segments = ["vision"] * 4 + ["projector"] + ["llm"] * 6
    # vision + projector (13) on 2 stages, llm (18) on 3: slowest 7 (the projector rides with the last vision layer)
    assert modality_partition(costs, segments, 5) == [0, 2, 5, 7, 9, 11]


def test_a_stage_without_trained_layers_takes_the_next_ones_first_trained_layer():
    """bf16 / ZeRO cannot hold a stage of frozen layers only (LoRA's frozen ViT + projector at P = 2):
    the boundary moves past the decoder's first trained layer; a stage that trains is left alone."""
    from mmpipe.planning.partition import every_stage_trains
    trains = [False] * 4 + [False, True, True, True]  # vision x3, projector, llm.embed (frozen), llm blocks
    assert every_stage_trains([0, 4, 8], trains) == [0, 6, 8]
    assert every_stage_trains([0, 5, 8], [True] * 8) == [0, 5, 8]
    assert every_stage_trains([0, 4, 6, 8], trains) == [0, 4, 6, 8]  # stage 1 would lose its only trained layer
