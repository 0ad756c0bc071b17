"""The one memory model: bytes per parameter by precision and ZeRO stage, optimizer state per stage,
activations in flight under 1F1B, per-stage peaks, the device's memory, and the micro-batch size
that fits a budget."""
from __future__ import annotations

from typing import Callable, Optional

from mmpipe.errors import ConfigError
from mmpipe.planning.profiler import LayerCost


# ---- memory model --------------------------------------------------------------------------------
def bytes_per_param(precision: str, zero_stage: int, data_parallel: int) -> tuple[float, float]:
    """(bytes per trainable parameter, bytes per frozen parameter) held by one rank: weights,
    gradients, and AdamW state (plus fp32 master weights and gradient accumulation under bf16/fp16),
    the optimizer part divided over data-parallel ranks under ZeRO-1."""
    shard = data_parallel if zero_stage >= 1 else 1
    if precision == "fp32":
        return 4 + 4 + 8 / shard, 4
    return 2 + 2 + (4 + 4 + 8) / shard, 2


def in_flight(stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations a stage holds at once under DeepSpeed's 1F1B schedule."""
    return max(1, min(stages - stage, micro_batches))


def stage_memory(costs: list[LayerCost], parts: list[int], micro_batches: int, precision: str,
                 zero_stage: int = 0, data_parallel: int = 1) -> list[int]:
    """Peak bytes per stage: weights + gradients + optimizer state + activations kept for backward
    (times the micro-batches in flight) + one received input and one outgoing output buffer."""
    per_train, per_frozen = bytes_per_param(precision, zero_stage, data_parallel)
    P = len(parts) - 1
    out = []
    for s in range(P):
        layers = costs[parts[s]:parts[s + 1]]
        static = sum(c.static_bytes(per_train, per_frozen) for c in layers)
        acts = sum(c.act_bytes for c in layers)
        buffers = layers[-1].out_bytes
        out.append(int(static + in_flight(s, P, micro_batches) * acts + buffers))
    return out


# ---- micro_batch_size: auto --------------------------------------------------------------------
def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pick_micro_batch(per_rank_batch: int, peak_of: Callable[[int], int], budget: int,
                     log: Optional[Callable[[str], None]] = None, min_size: int = 1) -> tuple[int, dict]:
    """Largest divisor m >= ``min_size`` of the per-rank batch with ``peak_of(m) <= budget``; peak
    memory grows with m, so this is a binary search over the divisors (a probe per step). Returns
    (m, {m: peak}). ``min_size``: the smallest micro-batch the loss is defined on (contrastive: 2)."""
    cands = [m for m in divisors(per_rank_batch) if m >= min_size]
    if not cands:
        raise ConfigError(f"parallel.micro_batch_size=auto: the per-rank batch of {per_rank_batch} has no divisor >= "
                          f"{min_size}, the smallest micro-batch this model's loss is defined on; raise train.batch_size")
    probed: dict = {}

    def fits(i):
        m = cands[i]
        if m not in probed:
            probed[m] = peak_of(m)
            if log:
                log(f"micro_batch_size probe {m}: peak {probed[m] / 2**20:.1f} MB of {budget / 2**20:.1f} MB")
        return probed[m] <= budget

    if not fits(0):
        raise ConfigError(f"parallel.micro_batch_size=auto: even a micro-batch of {cands[0]} needs "
                          f"{probed[cands[0]] / 2**30:.2f} GB, "
                          f"over parallel.memory_budget_gb={budget / 2**30:.2f}; raise the budget, use more pipeline "
                          "stages, or freeze/shrink the model")
    lo, hi = 0, len(cands) - 1  # cands[lo] fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return cands[lo], probed


# ---- memory -------------------------------------------------------------------------------------------
def state_bytes(precision: str) -> tuple[int, int, int]:
    """(weight, gradient, optimizer-state) bytes per trainable parameter: fp32 = 4, 4, 8 (Adam m, v);
    bf16/fp16 = 2, 2, 16 (fp32 master, m, v and the fp32 gradient accumulator)."""
    return (4, 4, 8) if precision == "fp32" else (2, 2, 16)


def dp_memory(costs: list, precision: str, zero: int, n: int) -> int:
    """Peak bytes of one data-parallel rank holding the whole model (see the module doc)."""
    w, g, o = state_bytes(precision)
    trainable = sum(c.trainable for c in costs)
    frozen = sum(c.params - c.trainable for c in costs)
    if zero == 0:
        static = trainable * (w + g + o)
    elif zero == 1:
        static = trainable * (w + g + o / n)
    elif zero == 2:
        static = trainable * (w + (g + o) / n)
    else:  # everything sharded; the largest layer is gathered whole (weights, and gradients in backward)
        static = trainable * (w + g + o) / n + max((c.params * w + c.trainable * g) for c in costs)
    static += frozen * w / (n if zero == 3 else 1)
    acts = sum(c.act_bytes for c in costs) + max(c.out_bytes for c in costs)
    return int(static + acts)


def optimizer_state_bytes(costs: list, precision: str, zero: int, dp: int, parts: Optional[list] = None) -> float:
    """Optimizer state on the fullest rank: the largest stage's (or, without ``parts``, the whole
    model's) trainable parameters times the state bytes per parameter, sharded over ``dp`` ranks
    from ZeRO-1 on (the term ``dp_memory`` and ``stage_memory`` count)."""
    o = state_bytes(precision)[2]
    spans = list(zip(parts, parts[1:])) if parts else [(0, len(costs))]
    trainable = max(sum(c.trainable for c in costs[a:b]) for a, b in spans)
    return trainable * o / (dp if zero >= 1 else 1)


def device_memory_bytes(world: int) -> int:
    """One rank's memory: the accelerator's, or (CPU) this machine's RAM shared by ``world`` ranks."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        return int(acc.total_memory())
    import psutil
    return int(psutil.virtual_memory().total // max(1, world))
