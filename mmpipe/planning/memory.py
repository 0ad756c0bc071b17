"""The one memory model: bytes per parameter by precision and ZeRO stage, optimizer state per stage,
activations in flight under 1F1B, per-stage peaks, the device's memory, and the micro-batch size
that fits a budget."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from mmpipe.errors import ConfigError
from mmpipe.parallel.schedules import Order, buffers, default_order, live_activations, queued_weight_grads


# ---- memory model --------------------------------------------------------------------------------
def optimizer_split(precision: str, zero_stage: int, pipelined: bool) -> tuple[int, int]:
    """The one rule for optimizer bytes per trainable parameter held from step to step (DeepSpeed
    0.19.8, torch AdamW): (bytes divided over the data-parallel ranks, bytes every rank holds whole).
    Every optimizer term of this module (``optimizer_bytes``, ``bytes_per_param``, ``_states``,
    ``optimizer_state_bytes``) and the step's sharding come from it; what the wrapper makes for its
    step only is ``step_split``'s. ``tests/test_memory_model.py`` pins both against the tensors a real
    engine allocates.

    - bf16 with a pipeline: DeepSpeed's ``BF16_Optimizer`` at ZeRO-0 and ZeRO-1 alike: the fp32
      master and Adam's m and v (12 bytes) over the data-parallel ranks, the flat gradient
      accumulator whole: fp32 under ZeRO-1 (``data_types.grad_accum_dtype: fp32``, which
      ``config.deepspeed`` sets), bf16 under ZeRO-0. Measured: 14 bytes at ZeRO-0, 10 at ZeRO-1 over
      2 ranks.
    - fp32: Adam's m and v (8 bytes), over the data-parallel ranks from ZeRO-1 on. (DeepSpeed's
      ZeRO optimizer also keeps an fp32 copy of the partition and an fp32 gradient partition for its
      step, 8 bytes over the data-parallel ranks, not counted here.)
    - bf16 / fp16 otherwise (``FP16_UnfusedOptimizer`` at ZeRO-0, DeepSpeed's ZeRO optimizer from
      ZeRO-1 on): the fp32 master, m and v (12 bytes), over the data-parallel ranks from ZeRO-1 on."""
    if precision == "bf16" and pipelined:
        return 12, (4 if zero_stage >= 1 else 2)
    per = 8 if precision == "fp32" else 12
    return (per, 0) if zero_stage >= 1 else (0, per)


def adamw_temp_bytes(kernel: str) -> int:
    """Bytes per parameter torch's AdamW step makes beside its state, by kernel
    (``config.deepspeed.adamw_kernel``): the multi-tensor one an fp32 temporary per parameter, the
    fused one none, the per-parameter loop a few of one parameter's at a time (none counted)."""
    return 4 if kernel == "foreach" else 0


def step_split(precision: str, zero_stage: int, pipelined: bool) -> tuple[int, int]:
    """Bytes per trainable parameter the optimizer's wrapper makes for its step and frees after it
    (split over the data-parallel ranks, whole), as ``optimizer_split``: the fp32 gradients it hands
    AdamW. They exist at the step only, not while a micro-batch's activations are held (counting
    them from step to step over-predicted a bf16 run's peak by 4 bytes per trainable parameter).

    - bf16 with a pipeline at ZeRO-0: ``BF16_Optimizer``'s fp32 copy of its bf16 accumulator's
      partition; at ZeRO-1 the fp32 accumulator's partition is the gradient (none made).
    - bf16 / fp16 otherwise: the fp32 gradients (``FP16_UnfusedOptimizer``: every parameter's;
      the ZeRO optimizer: its partition's).
    - fp32: none counted (see ``optimizer_split``)."""
    if precision == "fp32" or (pipelined and zero_stage >= 1 and precision == "bf16"):
        return 0, 0
    if precision == "bf16" and pipelined:
        return 4, 0
    return (4, 0) if zero_stage >= 1 else (0, 4)


def optimizer_bytes(precision: str, zero_stage: int, data_parallel: int, pipelined: bool,
                    trainable: float = 1) -> float:
    """Optimizer bytes of ``trainable`` parameters on one rank (``optimizer_split``)."""
    split, whole = optimizer_split(precision, zero_stage, pipelined)
    return trainable * split / data_parallel + trainable * whole


def state_bytes(precision: str) -> tuple[int, int, int]:
    """(weight, gradient, optimizer-state) bytes per trainable parameter: weights and gradients 4
    (fp32) or 2 (bf16/fp16); the optimizer's as ``optimizer_split`` gives it to one rank without
    ZeRO or a pipeline (8 fp32, 12 bf16/fp16)."""
    w = 4 if precision == "fp32" else 2
    return w, w, int(optimizer_bytes(precision, 0, 1, pipelined=False))


def bytes_per_param(precision: str, zero_stage: int, data_parallel: int,
                    pipelined: bool = True) -> tuple[float, float]:
    """(bytes per trainable parameter, bytes per frozen parameter) held by one pipeline rank: weights,
    gradients and optimizer state (``optimizer_bytes``)."""
    w, g, _ = state_bytes(precision)
    return w + g + optimizer_bytes(precision, zero_stage, data_parallel, pipelined), w


def held(stage: int, stages: int, micro_batches: int, order: Order) -> int:
    """Micro-batches whose activations a stage holds at once: its stream's (``schedules.live_activations``
    under the pipeline order ``order``)."""
    return live_activations(order.streams(stages, micro_batches)[stage])


def queued(stage: int, stages: int, micro_batches: int, order: Order) -> int:
    """Micro-batches whose weight-gradient inputs a split backward keeps queued at once on a stage
    (``schedules.queued_weight_grads``; 0 for an order whose backward is whole)."""
    return queued_weight_grads(order.streams(stages, micro_batches)[stage])


# bytes per pair of the global batch a step loss (``Family.batch_loss_grads``) holds at once: autograd
# through CLIP's whole softmax loss holds 5 fp32 B x B matrices (LiveBytes: 20.0 per pair); the blocked
# losses of the dual encoders (softmax and sigmoid, ``Family.step_loss_block_rows`` > 0) 6 fp32 block x B
# matrices (24.0)
STEP_LOSS_PAIR_BYTES = 20  # (a family may say its own: ``Family.step_loss_pair_bytes``; SigLIP's loss 24)
STEP_LOSS_BLOCK_PAIR_BYTES = 24
# ... and copies of the gathered features (fp32, every row of the global batch; F bytes) beside them, counted by
# LiveBytes around ``StepLossCache.fill`` (B 1024-4096, width 256-2048, blocks 128-4096): through autograd in one
# piece (or one block of a rank's own rows) 4 F; in blocks 5 F (the batch, its normalized copy, the blocks'
# accumulated gradient, one block's full-size gradient); and after the blocks, the gradient back through the
# normalization: 7.5 F with no pairs held (the larger of the two moments is the peak)
STEP_LOSS_FEATURE_COPIES = 4.0
STEP_LOSS_BLOCK_FEATURE_COPIES = 5.0
STEP_LOSS_END_FEATURE_COPIES = 7.5


@dataclass(frozen=True)
class RunShape:
    """What a run does beyond one forward and backward per micro-batch that changes its memory:
    activation checkpointing (every layer but the forward-only ones keeps only its input and
    recomputes its forward in backward), and a loss over the step (``features_bytes``: one
    micro-batch's fp32 features on one rank, cached with their gradients for the global batch on the
    last stage; ``frozen_prefix``: leading forward-only layers whose output stage 0 keeps per
    micro-batch from the first pass)."""
    checkpointing: bool = False
    forward_only: frozenset = frozenset()
    features_bytes: int = 0
    frozen_prefix: int = 0
    ties: tuple = ()  # (layer, layer, elements): one parameter in two layers, held once where both are
    batch_bytes: int = 0  # one micro-batch as loaded (inputs and labels): the step's are held by the stages that read data
    last_reads: bool = False  # the last stage reads the data too (a family with label fields)
    loss_rows: int = 0  # a step loss: the rows of one micro-batch (the global batch B = rows x micro-batches x DP)
    loss_pair_bytes: int = 0  # a step loss: bytes per pair of the global batch its loss holds at once (B x B)
    loss_block: int = 0  # a step loss computed in blocks of this many rows (0: all B at once): block x B pairs held
    loss_block_pair_bytes: int = 0  # ... and the bytes per pair the blocked computation holds
    loss_local: bool = False  # with D > 1 each rank computes only its own rows x B of the loss (``model.local_loss``)
    adamw_temp: int = 4  # bytes per parameter AdamW's step makes (``config.deepspeed.adamw_kernel``: multi-tensor 4,
    # fused none, the CPU's per-parameter loop one parameter's at a time: none counted)
    order: Order = field(default_factory=default_order)  # the pipeline order (``parallel.schedules``)
    expert_parallel: int = 1  # a MoE layer's routed experts (``LayerCost.experts``) split over this many ranks


def run_shape(prof: dict, order: Order, checkpointing: Optional[bool] = None) -> RunShape:
    """The ``RunShape`` a profile was made for (``planning.measure.get_profile`` marks it), under the pipeline
    order ``order``; ``checkpointing`` overrides the profile's."""
    sl = prof.get("step_loss") or {}
    return RunShape(bool(prof.get("checkpointing")) if checkpointing is None else checkpointing,
                    frozenset(prof.get("key", {}).get("forward_only", [])),
                    int(sl.get("features_bytes", 0)), int(sl.get("frozen_prefix", 0)),
                    tuple(tuple(t) for t in prof.get("ties", ())), int(prof.get("batch_bytes", 0)),
                    bool(prof.get("last_reads", False)), int(sl.get("rows", 0)), int(sl.get("pair_bytes", 0)),
                    int(sl.get("block_rows", 0)), int(sl.get("block_pair_bytes", 0)), bool(sl.get("local", False)),
                    int(prof.get("adamw_temp", 4)), order, int(prof.get("expert_parallel", 1)))


@dataclass
class MemoryBreakdown:
    """Predicted peak bytes of one rank, by what holds them."""
    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0  # saved for backward, times the micro-batches in flight (and a split backward's queue)
    buffers: float = 0.0  # stage-boundary transfers and the outputs kept for backward
    workspace: float = 0.0  # one layer's transient bytes in its forward/backward (profiled)
    step_workspace: float = 0.0  # the optimizer step's temporaries (AdamW's fp32 tensor per parameter, ``step_split``)
    features: float = 0.0  # a step loss's feature cache, a frozen prefix's memo, the step's batches
    loss: float = 0.0  # a step loss over the global batch: its B x B transient while computed (last stage)
    loss_in_training: bool = False  # computed while a micro-batch's activations are held (one pass at P = 1)
    grads_in_training: bool = True  # a backward ran before the fullest forward (more micro-batches than in flight)

    @property
    def total(self) -> int:
        """The largest of three moments: the last forward before the first backward (activations of
        every micro-batch in flight; the gradients only when an earlier micro-batch's backward made
        them: the step begins with none), the optimizer step (gradients complete, activations freed)
        and a step loss's computation (before the training pass, or within it with one micro-batch
        per rank)."""
        training = (self.activations + self.buffers + self.workspace + (self.loss if self.loss_in_training else 0)
                    + (self.grads if self.grads_in_training else 0))
        return int(self.weights + self.optimizer + self.features
                   + max(training, self.grads + self.step_workspace,
                         self.grads + (0 if self.loss_in_training else self.loss)))

    def to_dict(self) -> dict:
        return {**{k: int(v) for k, v in asdict(self).items()}, "total": self.total}


def _in_bytes(costs: list, i: int) -> int:
    c = costs[i]
    if c.in_bytes is not None:
        return c.in_bytes
    return costs[i - 1].out_bytes if i else c.act_bytes  # profiles older than in_bytes


def activation_bytes(costs: list, a: int, b: int, k: int, sch: RunShape) -> float:
    """Bytes layers ``a..b-1`` keep for backward with ``k`` micro-batches in flight: every layer's saved
    tensors and input per micro-batch; checkpointed, only the inputs per micro-batch plus one layer's
    saved tensors while its forward runs again in the backward."""
    ck = [i for i in range(a, b) if sch.checkpointing and costs[i].name not in sch.forward_only]
    held = sum(_in_bytes(costs, i) if i in ck else costs[i].act_bytes for i in range(a, b))
    recompute = max((costs[i].act_bytes - _in_bytes(costs, i) for i in ck), default=0)
    return k * held + recompute


def _states(costs: list, a: int, b: int, precision: str, zero: int, dp: int, ties: tuple = (),
            pipelined: bool = False, ep: int = 1) -> tuple:
    """(weights, gradients, optimizer state) bytes of layers ``a..b-1`` on one rank; a parameter tied
    between two of them (``RunShape.ties``) counted once; the optimizer's per ``optimizer_bytes``. With expert
    parallelism ``ep``, a MoE layer's routed experts (``LayerCost.experts``) are 1 / ``ep`` of them on each rank,
    their gradients too, and ZeRO partitions their optimizer state (and ZeRO-2 their gradients) over the ``dp / ep``
    ranks holding the same experts: the rest as without."""
    w, g, _ = state_bytes(precision)
    e_tr = sum(c.experts_trainable for c in costs[a:b]) if ep > 1 else 0
    e_fr = sum(c.experts - c.experts_trainable for c in costs[a:b]) if ep > 1 else 0
    trainable = sum(c.trainable for c in costs[a:b]) - e_tr
    frozen = sum(c.params - c.trainable for c in costs[a:b]) - e_fr
    names = {c.name: c for c in costs[a:b]}
    for first, second, n in ties:
        if first in names and second in names:
            if names[second].trainable >= n:  # the tied weight trains (at least that much of the layer does)
                trainable -= n
            else:
                frozen -= n
    n = dp if zero >= 1 else 1
    opt = optimizer_bytes(precision, zero, dp, pipelined, trainable)
    # the experts (none without expert parallelism: counted above with the rest)
    ew = (e_tr + e_fr) / ep * w
    eg = e_tr / ep * g / (dp // ep if zero == 2 else 1)
    eo = optimizer_bytes(precision, zero, dp // ep, pipelined, e_tr / ep) if e_tr else 0.0
    if zero <= 1:  # (DeepSpeed's pipeline runs ZeRO 0 and 1 only)
        return trainable * w + frozen * w + ew, trainable * g + eg, opt + eo
    if zero == 2:
        return trainable * w + frozen * w + ew, trainable * g / n + eg, opt + eo
    # ZeRO-3: everything sharded; the largest layer is gathered whole (weights, and gradients in backward)
    gathered = max(c.params * w + c.trainable * g for c in costs[a:b])
    return (trainable + frozen) * w / n + gathered, trainable * g / n, opt


def _features(costs: list, stage: int, stages: int, micro_batches: int, dp: int, sch: RunShape) -> float:
    """A step loss's feature cache (last stage) and frozen-prefix memo (first stage), and the step's
    micro-batches on the first stage (``held`` of them: the engine's input buffers); the last stage
    keeps their labels only."""
    out = 0.0
    if stage == 0:  # handed out as the engine takes them (``TrainData.step_batches``); a pipeline's input
        # buffers keep those in flight; one process, or a step loss's first pass, holds the step's all
        kept = micro_batches if stages == 1 or sch.features_bytes else held(stage, stages, micro_batches, sch.order)
        out += kept * sch.batch_bytes
    elif stage == stages - 1 and sch.last_reads:  # it keeps the labels only; a batch is whole while the
        out += sch.batch_bytes  # loader makes it (its pieces too, but at the step's start: not the peak)
    if sch.features_bytes and stage == stages - 1:  # the global batch's features and their gradients
        out += cached_features(sch, micro_batches, dp)
    if sch.frozen_prefix and stage == 0 and micro_batches > 1:  # the prefix's output per micro-batch
        out += micro_batches * costs[sch.frozen_prefix - 1].out_bytes
    return out


def stage_breakdown(costs: list, parts: list, micro_batches: int, precision: str, zero_stage: int = 0,
                    data_parallel: int = 1, shape: RunShape = RunShape()) -> list:
    """Predicted peak per pipeline stage (``MemoryBreakdown``): weights, gradients, optimizer state
    (sharded over ``data_parallel`` from ZeRO-1 on), activations of the micro-batches in flight
    under 1F1B (``activation_bytes``), the boundary buffers (the stage's outputs kept per micro-batch
    in flight until their backward, one received input and one received gradient), one layer's
    transient working set (``LayerCost.workspace``, the largest on the stage) and a step loss's
    feature cache. ``parts`` of one stage (P = 1) is the whole model on each data-parallel rank."""
    P = len(parts) - 1
    out = []
    streams = shape.order.streams(P, micro_batches) if P > 1 else None
    for s in range(P):
        a, b = parts[s], parts[s + 1]
        k = live_activations(streams[s]) if P > 1 else 1
        q = queued_weight_grads(streams[s]) if P > 1 else 0  # a split backward's weight-gradient inputs
        w, g, o = _states(costs, a, b, precision, zero_stage, data_parallel, shape.ties, pipelined=P > 1,
                          ep=shape.expert_parallel)
        # the outputs of each micro-batch in flight are kept for its backward (the last stage's for the
        # loss), and a non-last stage receives their gradient into one more buffer of that size; a pipe
        # buffer beyond those in flight holds a received input early (a zero-bubble order's)
        buffers_ = (k + (s < P - 1)) * costs[b - 1].out_bytes
        if s > 0:
            buffers_ += (1 + max(0, buffers(streams[s]) - max(k, 2))) * _in_bytes(costs, a)
        workspace = max(c.workspace for c in costs[a:b])
        last = costs[b - 1]
        if s == P - 1 and shape.checkpointing and last.name not in shape.forward_only:
            # the loss's backward holds its input's gradient (a decoder's logits) beside the last layer's
            # recomputed tensors: measured on the VLM's head stage (tiny VLM, P = 3: 11% short without it)
            workspace += last.out_bytes
        # torch's multi-tensor AdamW makes one fp32 temporary per (sharded) parameter in its step (its fused
        # kernel none: ``RunShape.adamw_temp``), beside the fp32 gradients DeepSpeed's wrapper makes for it
        # (``step_split``)
        # (expert parallelism: a rank steps 1 / E of the routed experts, sharded over the DP / E ranks holding them)
        E = shape.expert_parallel
        experts = sum(c.experts_trainable for c in costs[a:b]) if E > 1 else 0
        sharded = optimizer_split(precision, zero_stage, P > 1)[0] > 0
        made_split, made_whole = step_split(precision, zero_stage, P > 1)

        def step_bytes(n: float, dp: int) -> float:
            return n * (shape.adamw_temp / (dp if sharded else 1) + made_split / dp + made_whole)
        step = (step_bytes(sum(c.trainable for c in costs[a:b]) - experts, data_parallel)
                + step_bytes(experts / E, data_parallel // E))
        out.append(MemoryBreakdown(w, g, o, activation_bytes(costs, a, b, k, shape) + q * sum(
                                       c.w_bytes for c in costs[a:b]), buffers_, workspace, step,
                                   _features(costs, s, P, micro_batches, data_parallel, shape),
                                   _step_loss(s, P, micro_batches, data_parallel, shape),
                                   # one pass (one micro-batch per rank), or ZeRO-3's first micro-batch recomputing it
                                   P == 1 and (micro_batches == 1 or zero_stage == 3),
                                   # (DeepSpeed sets the gradients to None at each step's end)
                                   micro_batches > k))
    return out


def _step_loss(stage: int, stages: int, micro_batches: int, dp: int, sch: RunShape) -> float:
    """A loss over the global batch (``parallel.step_loss.StepLossCache.fill``), on the last stage of
    every data-parallel rank: ``loss_pair_bytes`` per pair of the rows it holds at once (CLIP's softmax: 5
    fp32 matrices at the peak: the logits, a log-softmax per direction, their gradients), ``loss_block``
    rows x B (at ``loss_block_pair_bytes``) when it is computed in blocks (B x B otherwise), and copies of
    the gathered features (``STEP_LOSS_*FEATURE_COPIES``). With ``loss_local`` and D > 1 a rank computes
    only its own rows (B / D) against all B, in blocks of at most ``loss_block``. None when the step is one
    micro-batch on one rank (the loss layer then runs in the graph: profiled)."""
    peak = step_loss_bytes(sch, micro_batches, dp) if stage == stages - 1 else 0.0
    return peak - cached_features(sch, micro_batches, dp) if peak else 0.0


def cached_features(sch: RunShape, micro_batches: int, dp: int) -> float:
    """What the feature cache keeps through the training pass: the gathered features of the global
    batch and their gradient (this rank's rows only with ``loss_local``)."""
    grad_rows = micro_batches if sch.loss_local and dp > 1 else micro_batches * dp
    return (micro_batches * dp + grad_rows) * sch.features_bytes


def step_loss_bytes(sch: RunShape, micro_batches: int, dp: int) -> float:
    """The peak of one rank's ``StepLossCache.fill`` (the last stage's): the loss's transient and the
    features it gathers and keeps (``_step_loss`` and ``cached_features``)."""
    if not sch.loss_pair_bytes or micro_batches * dp == 1:
        return 0.0
    rows = sch.loss_rows * micro_batches * dp
    own = rows // dp if sch.loss_local and dp > 1 else rows
    features = micro_batches * dp * sch.features_bytes
    if sch.loss_block and (own < rows or rows > sch.loss_block):  # in blocks (``Family.batch_loss_grads``)
        held = float(sch.loss_block_pair_bytes or sch.loss_pair_bytes) * min(sch.loss_block, own) * rows
        copies = STEP_LOSS_BLOCK_FEATURE_COPIES if own > sch.loss_block else STEP_LOSS_FEATURE_COPIES
        return max(held + copies * features, STEP_LOSS_END_FEATURE_COPIES * features)
    # autograd through the whole B x B loss
    return float(sch.loss_pair_bytes) * rows * rows + STEP_LOSS_FEATURE_COPIES * features


def stage_memory(costs: list, parts: list, micro_batches: int, precision: str, zero_stage: int = 0,
                 data_parallel: int = 1, shape: RunShape = RunShape()) -> list[int]:
    """Peak bytes per stage (``stage_breakdown``'s totals)."""
    return [m.total for m in stage_breakdown(costs, parts, micro_batches, precision, zero_stage, data_parallel,
                                             shape)]


def dp_memory(costs: list, precision: str, zero: int, n: int, shape: RunShape = RunShape(),
              micro_batches: int = 1) -> int:
    """Peak bytes of one data-parallel rank holding the whole model (ZeRO 0-3)."""
    return stage_memory(costs, [0, len(costs)], micro_batches, precision, zero, n, shape)[0]


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


def optimizer_state_bytes(costs: list, precision: str, zero: int, dp: int, parts: Optional[list] = None) -> float:
    """Optimizer state on the fullest rank: the largest stage's (or, without ``parts``, the whole
    model's) trainable parameters times ``optimizer_bytes`` (a pipeline when ``parts`` has more than
    one stage): the term ``dp_memory`` and ``stage_memory`` count."""
    spans = list(zip(parts, parts[1:])) if parts else [(0, len(costs))]
    trainable = max(sum(c.trainable for c in costs[a:b]) for a, b in spans)
    return optimizer_bytes(precision, zero, dp, len(spans) > 1, trainable)


def device_memory_bytes(world: int) -> int:
    """One rank's memory: the accelerator's, or (CPU) this machine's RAM shared by ``world`` ranks."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        return int(acc.total_memory())
    import psutil
    return int(psutil.virtual_memory().total // max(1, world))
