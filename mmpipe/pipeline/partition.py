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


def modality_partition(costs: Sequence[float], branches: Sequence[str], num_stages: int) -> list[int]:
    """Stages never mix branches: the image layers (a prefix) get k stages and the text layers
    (the rest) P-k, with k chosen to minimise the slowest stage; each branch is split exactly.
    P = 1 puts everything on one stage."""
    n = len(costs)
    if num_stages == 1:
        return [0, n]
    first = list(branches)
    split = next((i for i, b in enumerate(first) if b != first[0]), n)
    if any(b == first[0] for b in first[split:]):
        raise ValueError("modality placement needs the layers of each branch to be contiguous")
    a, b = list(costs[:split]), list(costs[split:])
    if not a or not b:
        return min_max_partition(costs, num_stages)
    best = None
    for k in range(1, num_stages):
        if k > len(a) or num_stages - k > len(b):
            continue
        pa = min_max_partition(a, k)
        pb = min_max_partition(b, num_stages - k)
        score = max(bottleneck(a, pa), bottleneck(b, pb))
        if best is None or score < best[0]:
            best = (score, pa[:-1] + [split + x for x in pb])
    if best is None:
        raise ValueError(f"cannot place {len(a)} image and {len(b)} text layers on {num_stages} separate stages")
    return best[1]


def stage_lists(names: Sequence[str], parts: Sequence[int]) -> list[list[str]]:
    return [list(names[parts[s]:parts[s + 1]]) for s in range(len(parts) - 1)]


def parts_from_lists(names: Sequence[str], lists: Sequence[Sequence[str]]) -> list[int]:
    """Inverse of ``stage_lists``: validates that the lists cover ``names`` in order."""
    flat = [n for stage in lists for n in stage]
    if flat != list(names):
        raise ValueError("stage lists must cover every layer exactly once, in model order")
    parts = [0]
    for stage in lists:
        if not stage:
            raise ValueError("every stage needs at least one layer")
        parts.append(parts[-1] + len(stage))
    return parts
