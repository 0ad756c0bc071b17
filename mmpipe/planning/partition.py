"""Contiguous partitions of the layer sequence into pipeline stages.

A partition is data: ``parts`` = P+1 layer indices (DeepSpeed's convention), shown to people as
per-stage lists of layer names. ``min_max_partition`` is exact (dynamic programming), not greedy.
"""
from __future__ import annotations

from typing import Optional, Sequence


def min_max_partition(costs: Sequence[float], num_stages: int, *, memory: Optional[Sequence[float]] = None,
                      memory_cap: Optional[float] = None) -> list[int]:
    """Split ``costs`` into ``num_stages`` non-empty contiguous runs minimising the largest run's sum.

    With ``memory``/``memory_cap`` every run's memory sum must stay under the cap. Returns
    ``parts`` (len P+1, parts[0] = 0, parts[-1] = n). Raises ValueError if no split fits.
    Ties on the bottleneck are broken towards the smaller sum of squares (more even stages).
    """
    n, P = len(costs), num_stages
    if P < 1 or n < P:
        raise ValueError(f"cannot split {n} layers into {P} non-empty stages")
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + float(c))
    mpre = [0.0]
    for m in (memory or [0.0] * n):
        mpre.append(mpre[-1] + float(m))
    INF = (float("inf"), float("inf"))

    def seg(i, j):  # layers i..j-1
        if memory_cap is not None and mpre[j] - mpre[i] > memory_cap:
            return None
        return pre[j] - pre[i]

    # best[k][j] = (bottleneck, sum of squares) for the first j layers in k stages
    best = [[INF] * (n + 1) for _ in range(P + 1)]
    arg = [[-1] * (n + 1) for _ in range(P + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, P + 1):
        for j in range(k, n - (P - k) + 1):
            for i in range(k - 1, j):
                prev = best[k - 1][i]
                if prev == INF:
                    continue
                s = seg(i, j)
                if s is None:
                    continue
                cand = (max(prev[0], s), prev[1] + s * s)
                if cand < best[k][j]:
                    best[k][j], arg[k][j] = cand, i
    if best[P][n] == INF:
        raise ValueError(f"no split of {n} layers into {P} stages fits the memory cap {memory_cap}")
    parts = [n]
    j = n
    for k in range(P, 0, -1):
        j = arg[k][j]
        parts.append(j)
    return parts[::-1]


def bottleneck(costs: Sequence[float], parts: Sequence[int]) -> float:
    return max(sum(costs[parts[s]:parts[s + 1]]) for s in range(len(parts) - 1))


def segment_runs(segments: Sequence[str]) -> list[tuple[int, int]]:
    """(start, stop) of each run of equal segment tags, in order; a tag may not come back later."""
    runs, seen = [], set()
    for i, tag in enumerate(segments):
        if runs and segments[runs[-1][0]] == tag:
            runs[-1] = (runs[-1][0], i + 1)
            continue
        if tag in seen:
            raise ValueError(f"modality placement needs the layers of each segment to be contiguous ({tag!r} "
                             "comes back after another segment)")
        seen.add(tag)
        runs.append((i, i + 1))
    return runs


def modality_partition(costs: Sequence[float], segments: Sequence[str], num_stages: int) -> list[int]:
    """Stages never mix segments (see ``_segment_partition``), and a segment of one layer (a VLM's
    projector) is fused to the layer before it, never a stage of its own: vision + projector | llm,
    as LLaVA's recipes split it."""
    runs = segment_runs(segments)
    single = {a for a, b in runs if b - a == 1 and a > 0}
    starts = [i for i in range(len(costs)) if i not in single]  # each unit's first layer
    if num_stages > len(starts):  # more stages than that allows: every layer may be a stage
        starts = list(range(len(costs)))
    ends = starts[1:] + [len(costs)]
    unit_costs = [sum(costs[a:b]) for a, b in zip(starts, ends)]
    parts = _segment_partition(unit_costs, [segments[a] for a in starts], num_stages)
    return [starts[u] if u < len(starts) else len(costs) for u in parts]


def _segment_partition(costs: Sequence[float], segments: Sequence[str], num_stages: int) -> list[int]:
    """Stages never mix segments (e.g. vision | text, or vision | projector | llm): the K contiguous
    segments share the P stages, each getting at least one, with the counts chosen (exactly, by
    dynamic programming) to minimise the slowest stage; each segment is split exactly. With fewer
    stages than segments (a VLM's vision | projector | llm on 2 stages), stages hold whole
    segments: the exact min-max partition over the segments, so a stage boundary never falls
    inside one (the vision tower and projector stay apart from the decoder)."""
    n = len(costs)
    if num_stages == 1:
        return [0, n]
    runs = segment_runs(segments)
    K = len(runs)
    if K == 1:
        return min_max_partition(costs, num_stages)
    if num_stages < K:
        cut = min_max_partition([sum(costs[a:b]) for a, b in runs], num_stages)
        return [runs[k][0] for k in cut[:-1]] + [n]
    seg_costs = [list(costs[a:b]) for a, b in runs]
    # cost[j][k]: bottleneck of segment j split into k stages (None when it has fewer layers than k)
    cost = [{k: bottleneck(c, min_max_partition(c, k)) for k in range(1, min(len(c), num_stages - K + 1) + 1)}
            for c in seg_costs]
    INF = float("inf")
    best = [[INF] * (num_stages + 1) for _ in range(K + 1)]  # best[j][s]: first j segments on s stages
    arg = [[0] * (num_stages + 1) for _ in range(K + 1)]
    best[0][0] = 0.0
    for j in range(1, K + 1):
        for s in range(j, num_stages + 1):
            for k, c in sorted(cost[j - 1].items(), reverse=True):  # ties: more stages to later segments
                if k <= s and best[j - 1][s - k] < INF and max(best[j - 1][s - k], c) < best[j][s]:
                    best[j][s], arg[j][s] = max(best[j - 1][s - k], c), k
    if best[K][num_stages] == INF:
        raise ValueError(f"cannot place segments of {', '.join(str(b - a) for a, b in runs)} layers on "
                         f"{num_stages} separate stages")
    counts, s = [], num_stages
    for j in range(K, 0, -1):
        counts.append(arg[j][s])
        s -= arg[j][s]
    parts: list = []
    for (a, _), c, k in zip(runs, seg_costs, reversed(counts)):
        parts += [a + x for x in min_max_partition(c, k)[:-1]]
    return parts + [n]




def every_stage_trains(parts: Sequence[int], trains: Sequence[bool]) -> list[int]:
    """``parts`` with each stage that holds no trained layer extended over the next stage's layers up
    to its first trained one (DeepSpeed's bf16 and ZeRO optimizers cannot hold a stage without a
    trainable parameter: under LoRA the frozen vision tower alone on stage 0); unchanged where that
    would empty the next stage of trained layers."""
    parts = list(parts)
    for s in range(len(parts) - 2):
        if any(trains[parts[s]:parts[s + 1]]):
            continue
        j = next((i for i in range(parts[s + 1], parts[s + 2]) if trains[i]), None)
        if j is not None and any(trains[j + 1:parts[s + 2]]):
            parts[s + 1] = j + 1
    return parts
