"""Every private DeepSpeed API mmpipe touches, in one place.

Checked on DeepSpeed ``CHECKED`` (CPU accelerator + gloo here; the same code paths under NCCL).
Each function names the DeepSpeed internals it relies on, and the table lists every function of this
module (``tests/test_ds_compat.py`` checks that it does). That file holds one test per patch that
fails when an installed DeepSpeed no longer has what the patch expects, and names the run test
that exercises the patch's behaviour.

| patch | DeepSpeed internals | why |
|---|---|---|
| ``check_version`` | ``deepspeed.__version__`` (public) | a DeepSpeed newer than ``CHECKED`` is named once |
| ``fix_recv_buffer_dtype`` | ``PipelineEngine._allocate_or_extend_buffers``, ``_grad_layer_buf``, ``_allocate_buffer`` | buffers reused across dtypes with 3+ stages |
| ``wrap_instructions`` | ``PipelineEngine._INSTRUCTION_MAP`` | the per-instruction stage clock |
| ``split_backward``, ``instruction_class`` | ``PipelineEngine._INSTRUCTION_MAP``, ``grad_layer``, ``_running_engine_backward``, ``using_bf16_optimizer``, ``BF16_Optimizer.clear_lp_grads`` / ``update_hp_grads`` / ``immediate_grad_update``, ``deepspeed.runtime.pipe.schedule.BufferOpInstruction`` / ``PipeInstruction`` | the backward as input gradient (B) and weight gradients (W) apart: zero-bubble orders |
| ``one_backward`` | ``PipelineEngine._INSTRUCTION_MAP``, ``pipe_buffers['outputs']``, ``grad_layer``, ``_exec_backward_pass`` calling ``out.backward`` per float output | a stage sending several float tensors (DeepStack's features, a MoE's router statistics) walks its graph once per backward, not once per tensor |
| ``loss_per_buffer`` | ``PipelineEngine._INSTRUCTION_MAP``, ``loss``, ``_exec_forward_pass``, ``_exec_backward_pass`` | a last stage whose order runs two forwards before a backward (``gpipe``) backpropagates each micro-batch's own loss |
| ``set_train_schedule`` | ``PipelineEngine._train_schedule``, ``deepspeed.runtime.pipe.schedule`` (``PipeSchedule`` and its instruction classes) | the run's pipeline order (``parallel.schedules``) as the engine's schedule |
| ``is_zero_optimizer`` | the class name ``DeepSpeedZeroOptimizer`` | grouped clipping under ZeRO-1/2 |
| ``wrap_zero_step``, ``zero_group_grads`` | ``DeepSpeedZeroOptimizer.step``, ``DeepSpeedZeroOptimizer_Stage3.step``, ``_get_preflattened_grad_partition``, ``averaged_gradients`` | grouped clipping under ZeRO-1/2; ``log.grads`` under ZeRO-2/3 |
| ``ensure_zero_optimizer_state`` | ``DeepSpeedZeroOptimizer.single_partition_of_fp32_groups``, ``BF16_Optimizer.fp32_groups_flat_partition``, ``DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat``, ``_lazy_init_hp_params_optimizer_state``, ``_hp_optimizer_states_linked`` | a layout-free resume before any step |
| ``relink_optimizer_state`` | ``_lazy_init_hp_params_optimizer_state``, ``_hp_optimizer_states_linked`` (``DeepSpeedZeroOptimizer``, ``BF16_Optimizer``) | every param group's Adam state readable by parameter |
| ``skip_cpu_shm_allreduce`` | ``deepspeed.comm.torch.build_shm_op`` | no shared-memory all-reduce buffer per rank in /dev/shm on CPU |
| ``eval_batch_in_train_mode`` | ``PipelineEngine.eval_batch`` calling ``self.module.eval()`` | a step loss's first pass in training mode |
| ``reset_total_loss`` | ``PipelineEngine.total_loss`` | eval after a training step |
| ``set_stage_bounds`` | ``PipelineModule._topo``, ``global_rank``, ``_set_bounds``, ``parts`` | explicit stage boundaries |
| ``pipe_layer_count`` | ``PipelineModule._layer_specs`` | explicit stage boundaries checked against the layers |
| ``stage_layers`` | ``PipelineModule.forward_funcs`` | this stage's layers under the plain model's names |
| ``stage_global_ranks`` | ``PipelineModule._grid``, ``PipelineParallelGrid.data_parallel_size``, ``stage_to_global`` | weights tied across stages |
| ``optimizer_kind`` | the class names ``DeepSpeedZeroOptimizer``, ``DeepSpeedZeroOptimizer_Stage3``, ``BF16_Optimizer``, ``FP16_UnfusedOptimizer`` | which path saves and restores layout-free optimizer state |
| ``fix_fp16_backward_scaling`` | ``DeepSpeedEngine.backward``, ``FP16_UnfusedOptimizer.loss_scale_config`` | fp16 at ZeRO-0 trained with gradients divided by the loss scale (0.19.8) |
| ``dynamic_loss_scale`` | ``loss_scale_config.cur_scale``, ``loss_scaler.cur_scale`` | fp16 loss-scale calibration is not a bad step |
| ``set_zero3_partition`` | ``param.ds_tensor``, ``ds_process_group`` | a ZeRO-3 weight restored by name |
| ``is_zero3_param`` | ``param.ds_id`` | a ZeRO-3 weight restored by name |
| ``set_engine_step`` | ``DeepSpeedEngine.global_steps``, ``global_samples`` | a resume in another layout continues the engine's counters |
| ``no_initial_unfused_step`` | ``FP16_UnfusedOptimizer.initialize_optimizer_states`` | bf16/fp16 at P = 1 without ZeRO began Adam one step late (0.19.8) |
| ``one_read_overflow_check`` | ``CheckOverflow.has_overflow_serial`` | fp16/bf16 at P = 1 without ZeRO read every gradient's finiteness to the host in turn: one device synchronisation per parameter per step |
| ``foreach_unfused_step`` | ``FP16_UnfusedOptimizer.step``, ``fp16_groups``, ``fp32_groups``, ``overflow_checker``, ``_skip_invalid_grad_norm``, ``_update_scale``, ``loss_scale_config.cur_scale``, ``clip_grad`` | fp16/bf16 at P = 1 without ZeRO: five kernels per parameter per step (a norm, a cast, an unscale by 1, a copy back) |
| ``no_single_rank_allreduce`` | ``DeepSpeedEngine.enable_backward_allreduce``, ``dp_world_size`` | ZeRO-0 at P = 1 on one rank flattened, all-reduced and copied back every gradient per step |
| ``create_expert_groups`` | ``deepspeed.utils.groups._create_expert_and_data_parallel`` (``mp_size``, ``pp_size``), ``_get_expert_parallel_group`` / ``_rank`` | expert parallelism: the expert-parallel group of consecutive data-parallel ranks of a stage, and the expert-data-parallel group DeepSpeed reduces expert gradients over |
| ``moe_engine`` | ``DeepSpeedEngine._configure_distributed_model``, ``has_moe_layers``, ``deepspeed.moe.utils.is_moe_param`` | an engine over mmpipe's expert slices (no ``deepspeed.moe`` layer) reduces and partitions them as DeepSpeed's own MoE parameters |
| ``expert_parallel_group`` | ``DeepSpeedEngine.has_moe_layers``, ``expert_parallel_group`` (its dict of expert-parallel groups by name) | grouped clipping sums replicated expert slices' squares over their group |
| ``expert_param_groups``, ``group_name`` | the param-group keys ``moe`` and ``name`` (``DeepSpeedZeroOptimizer._configure_moe_settings``, ``configure_moe_param_groups``) | expert slices in their own optimizer groups (partitioned over the expert-data-parallel group), mmpipe's group name kept |
| ``without_moe_checkpoint`` | ``DeepSpeedEngine.save_checkpoint`` branching on ``has_moe_layers`` (``_save_moe_checkpoint`` walks ``deepspeed.moe`` layers only) | DeepSpeed's plain per-stage files; the expert slices are saved by mmpipe (``train.layout_free_state``) |
| ``unfused_masters`` | ``FP16_UnfusedOptimizer.fp16_groups``, ``fp32_groups`` | layout-free optimizer state of fp16/bf16 at P = 1 without ZeRO |
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable

from mmpipe.parallel.schedules import buffers

CHECKED = ("0.16", "0.19.8")  # oldest allowed by setup.py .. newest checked


def check_version() -> None:
    """Warn once when the installed DeepSpeed is newer than the newest one checked."""
    import deepspeed
    from packaging.version import Version
    if Version(deepspeed.__version__.split("+")[0]) > Version(CHECKED[1]):
        warnings.warn(f"mmpipe's DeepSpeed patches were checked on {CHECKED[0]}..{CHECKED[1]}, not "
                      f"{deepspeed.__version__}; run tests/test_ds_compat.py", stacklevel=2)


def fix_recv_buffer_dtype(engine) -> None:
    """Work around DeepSpeed reusing a pipe receive/grad buffer whose dtype is stale.

    ``PipelineEngine._allocate_or_extend_buffers`` keys buffers by position and only checks the
    element count, so with 3+ stages a buffer that last held int64 token ids can be handed back as
    the buffer for a float gradient (or the reverse). Reallocate when the dtype differs."""
    original = engine._allocate_or_extend_buffers

    def allocate(idx, shape, dtype):
        bufs = engine._grad_layer_buf
        if idx < len(bufs) and bufs[idx].dtype != dtype:
            bufs[idx] = engine._allocate_buffer(shape, dtype=dtype, num_buffers=1)[0]
        return original(idx, shape, dtype)

    engine._allocate_or_extend_buffers = allocate


def wrap_instructions(engine, wrap: Callable) -> None:
    """Route every pipeline instruction of ``engine`` through ``wrap(name, fn)`` (the engine
    dispatches through its class-level ``_INSTRUCTION_MAP``; this instance gets its own copy, which
    keeps an earlier wrap or added instruction)."""
    table = dict(engine._INSTRUCTION_MAP)
    engine._INSTRUCTION_MAP = {cls: wrap(cls.__name__, fn) for cls, fn in table.items()}


_SPLIT: dict = {}


def instruction_class(kind: str):
    """DeepSpeed's instruction class of an action kind, with the split backward's two added (a ``BufferOpInstruction``
    ``BackwardInputPass(buffer_id, micro_batch=)`` and a ``PipeInstruction`` ``BackwardWeightPass(micro_batch=)``)."""
    from deepspeed.runtime.pipe import schedule as S
    if not _SPLIT:
        _SPLIT["BackwardInputPass"] = type("BackwardInputPass", (S.BufferOpInstruction,), {})
        _SPLIT["BackwardWeightPass"] = type("BackwardWeightPass", (S.PipeInstruction,), {})
    return _SPLIT.get(kind) or getattr(S, kind)


def _instruction(a, buffers: int):
    """The instruction of an action: its buffer (micro-batch modulo ``buffers``) where it takes one; a split backward's
    with its micro-batch too (the weight gradients', which touch no buffer, with that alone)."""
    cls = instruction_class(a.kind)
    if a.micro_batch is None:
        return cls()
    if a.kind == "BackwardWeightPass":
        return cls(micro_batch=a.micro_batch)
    extra = {"micro_batch": a.micro_batch} if a.kind == "BackwardInputPass" else {}
    return cls(a.micro_batch % buffers, **extra)


def split_backward(engine, store) -> None:
    """Teach ``engine`` the two halves of a backward (``parallel.zero_bubble``): ``BackwardInputPass`` is its own
    ``BackwardPass`` with the stage's split layers queueing their weight-gradient inputs into ``store`` (the received
    gradient copied first: DeepSpeed receives the next one into the same buffer, and a queued output gradient may be
    it); ``BackwardWeightPass`` computes one micro-batch's weight gradients as a backward does on a non-last stage
    (``_running_engine_backward`` set, so ZeRO's post-backward hook stands aside; the bf16 optimizer's low-precision
    gradients moved into its fp32 buffers, which without ``immediate_grad_update`` only its backward does)."""
    import torch
    from deepspeed.runtime.pipe import schedule as S
    table = dict(engine._INSTRUCTION_MAP)
    backward = table[S.BackwardPass]

    def backward_input(self, buffer_id, micro_batch):
        received = self.grad_layer
        if received is not None and not self.is_last_stage():
            self.grad_layer = received.clone() if torch.is_tensor(received) else [t.clone() for t in received]
        try:
            with store.backward_input(micro_batch):
                backward(self, buffer_id)
        finally:
            self.grad_layer = received

    def backward_weight(self, micro_batch):
        opt = self.optimizer
        moves = self.using_bf16_optimizer and not getattr(opt, "immediate_grad_update", False)
        if moves:
            opt.clear_lp_grads()  # (what B left there is in the fp32 buffers already)
        self._running_engine_backward = True
        try:
            store.weight_gradients(micro_batch)
        finally:
            self._running_engine_backward = False
        if moves:
            opt.update_hp_grads(clear_lp_grads=True)

    table[instruction_class("BackwardInputPass")] = backward_input
    table[instruction_class("BackwardWeightPass")] = backward_weight
    engine._INSTRUCTION_MAP = table


def one_backward(engine) -> None:
    """DeepSpeed's non-last stage backpropagates each float output it sent by its own ``out.backward(grad)``: a
    second output that depends on the stage's earlier layers (DeepStack's features after a ViT block, a MoE's
    router statistics after every routed block) walks the stage's graph again, and a checkpointed layer
    recomputes again. Give the backward one root instead: the sum of each output times its received gradient
    (whose gradient with respect to each output is exactly that gradient), backpropagated with gradient 1."""
    import torch
    from deepspeed.runtime.pipe import schedule as S
    table = dict(engine._INSTRUCTION_MAP)
    backward = table[S.BackwardPass]

    def backward_pass(self, buffer_id):
        outputs = self.pipe_buffers["outputs"][buffer_id]
        floats = [t for t in outputs if t.is_floating_point()] if isinstance(outputs, tuple) else []
        if self.is_last_stage() or len(floats) < 2 or self.is_pipe_partitioned:
            return backward(self, buffer_id)
        received = self.grad_layer
        if not all(t.requires_grad for t in floats):  # (DeepSpeed's own backward names the tensor)
            return backward(self, buffer_id)
        root = sum((t * g.to(t.dtype)).sum(dtype=torch.float32) for t, g in zip(floats, received))
        self.pipe_buffers["outputs"][buffer_id] = (root,)
        self.grad_layer = (torch.ones((), dtype=root.dtype, device=root.device),)
        try:
            return backward(self, buffer_id)
        finally:
            self.grad_layer = received

    table[S.BackwardPass] = backward_pass
    engine._INSTRUCTION_MAP = table


def loss_per_buffer(engine) -> None:
    """DeepSpeed's last stage backpropagates ``self.loss``, which holds the latest forward's loss: right
    for 1F1B (each backward follows its own forward), wrong for an order that runs two forwards before a
    backward (``gpipe``: the second backward went through a freed graph). Keep each pipe buffer's loss and
    put it back in ``loss`` before the buffer's backward."""
    import torch
    from deepspeed.runtime.pipe import schedule as S
    table = dict(engine._INSTRUCTION_MAP)
    forward, backward = table[S.ForwardPass], table[S.BackwardPass]
    losses: dict = {}

    def forward_pass(self, buffer_id):
        out = forward(self, buffer_id)
        if self.is_last_stage() and torch.is_grad_enabled():  # (not eval_batch's forwards)
            losses[buffer_id] = self.loss
        return out

    def backward_pass(self, buffer_id):
        if self.is_last_stage():
            self.loss = losses.pop(buffer_id)
        return backward(self, buffer_id)

    table[S.ForwardPass], table[S.BackwardPass] = forward_pass, backward_pass
    engine._INSTRUCTION_MAP = table


def set_train_schedule(engine, actions: list) -> None:
    """Make ``engine.train_batch`` run ``actions`` (``parallel.schedules.Action``: DeepSpeed's instruction
    names, with micro-batches) instead of its ``TrainSchedule``: ``PipelineEngine._train_schedule`` is
    overridden on this instance (as DeepSpeed's own ``DualPipeVEngine`` overrides it on its class); a
    micro-batch's buffer is its index modulo the buffers the stream needs; a split backward's instructions carry
    their micro-batch (``instruction_class``)."""
    from deepspeed.runtime.pipe import schedule as S

    n = buffers(actions)
    cmds = [_instruction(a, n) for a in actions]

    class Stream(S.PipeSchedule):
        def steps(self):
            for c in cmds:
                yield [c]

        def num_pipe_buffers(self):
            return n

    engine._train_schedule = lambda: Stream(engine.micro_batches, engine.num_stages, engine.stage_id)


def is_zero_optimizer(optimizer) -> bool:
    return type(optimizer).__name__ == "DeepSpeedZeroOptimizer"


def wrap_zero_step(zero_optimizer, before: Callable[[], None]) -> None:
    """Call ``before()`` at the start of ``DeepSpeedZeroOptimizer.step`` (ZeRO-1/2 step the inner
    optimizer once per group and build each group's gradient just before it, so a step pre-hook on
    the inner optimizer would see one group at a time) or ``DeepSpeedZeroOptimizer_Stage3.step`` (its
    reduced fp32 gradient partitions are there until it steps: ``safe_get_full_grad``'s window)."""
    original = zero_optimizer.step

    def step(*args, **kwargs):
        before()
        return original(*args, **kwargs)

    zero_optimizer.step = step


def ensure_zero_optimizer_state(ds_optimizer, inner, step: float) -> None:
    """``DeepSpeedZeroOptimizer``, ``DeepSpeedZeroOptimizer_Stage3`` and ``BF16_Optimizer`` create the
    Adam state of their flat fp32 partitions at the first step (and the first two only then link it
    to the parameters; ``safe_set_full_optimizer_state`` needs the state and that link): create it
    (zeros, at ``step``) and link it, for a resume before any step."""
    groups = (getattr(ds_optimizer, "single_partition_of_fp32_groups", None)
              or getattr(ds_optimizer, "fp32_groups_flat_partition", None)
              or getattr(ds_optimizer, "fp32_partitioned_groups_flat", None))  # ZeRO-3 (no link to make)
    if groups is None:
        return
    import torch
    for flat in groups:
        if flat not in inner.state:
            inner.state[flat] = {"step": torch.tensor(float(step)), "exp_avg": torch.zeros_like(flat),
                                 "exp_avg_sq": torch.zeros_like(flat)}
    if hasattr(ds_optimizer, "_lazy_init_hp_params_optimizer_state"):
        ds_optimizer._hp_optimizer_states_linked = False
        ds_optimizer._lazy_init_hp_params_optimizer_state()


def skip_cpu_shm_allreduce() -> None:
    """On the CPU accelerator DeepSpeed's process-group wrapper builds its shared-memory all-reduce
    (used only by ``inference_all_reduce``, never by training) and gives every rank a ~65 MB
    buffer in /dev/shm that outlives the run; mmpipe does not use it, so it is not built."""
    import importlib
    # (``import deepspeed.comm.torch as m`` would bind the ``torch`` name deepspeed.comm imports)
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    ds_torch.build_shm_op = lambda: None


def relink_optimizer_state(ds_optimizer) -> None:
    """``DeepSpeedZeroOptimizer`` / ``BF16_Optimizer`` link each parameter to its Adam state once,
    right after the first param group's first step, when the other groups have no state yet (their
    fragments stay empty for good): link again, once every group has stepped, before reading the
    state with ``safe_get_full_optimizer_state``."""
    if hasattr(ds_optimizer, "_lazy_init_hp_params_optimizer_state"):
        ds_optimizer._hp_optimizer_states_linked = False
        ds_optimizer._lazy_init_hp_params_optimizer_state()


def zero_group_grads(zero_optimizer, i: int) -> list:
    """The reduced gradient partition(s) of param group ``i`` of a ``DeepSpeedZeroOptimizer``."""
    flat = zero_optimizer._get_preflattened_grad_partition(i)
    if flat is not None:
        return [flat]
    return [t for t in (zero_optimizer.averaged_gradients.get(i) or []) if t is not None]


@contextlib.contextmanager
def eval_batch_in_train_mode(engine):
    """``PipelineEngine.eval_batch`` runs its forward-only schedule with the module in eval mode
    (``self.module.eval()``); a step loss's first pass needs training mode (dropout, as in the pass
    that trains): the module is put in training mode (an evaluation's ``eval_batch`` left it in eval
    mode) and its ``eval`` is a no-op meanwhile. ``train_batch`` sets train mode anyway."""
    module = engine.module
    module.train()
    module.eval = lambda: module
    try:
        yield
    finally:
        del module.eval


def reset_total_loss(engine) -> None:
    """``eval_batch()`` adds every forward output to ``total_loss``, which still holds the training
    loss (a scalar) after ``train_batch()``: reset it, or feature tensors cannot be added to it."""
    engine.total_loss = None


def set_stage_bounds(module, parts: list) -> None:
    """Give a ``PipelineModule`` explicit boundaries (``parts``: P + 1 layer indices) from inside its
    ``_partition_layers`` override: DeepSpeed has no argument for them."""
    module.parts = list(parts)
    stage = module._topo.get_coord(module.global_rank).pipe
    module._set_bounds(start=module.parts[stage], stop=module.parts[stage + 1])


def pipe_layer_count(module) -> int:
    """How many layers a ``PipelineModule`` was given (its ``_layer_specs``), over all stages."""
    return len(module._layer_specs)


def stage_layers(module) -> list:
    """The layers a ``PipelineModule`` built for this stage, in order (``forward_funcs``: the modules
    and functions its ``forward`` runs)."""
    return module.forward_funcs


def stage_global_ranks(module, stage: int) -> list:
    """The global rank holding pipeline stage ``stage`` in each data-parallel replica (index: the
    data-parallel rank), from a ``PipelineModule``'s grid (``_grid``: ``data_parallel_size``,
    ``stage_to_global``)."""
    grid = module._grid
    return [grid.stage_to_global(stage_id=stage, data=dp) for dp in range(grid.data_parallel_size)]


def optimizer_kind(ds_optimizer) -> str:
    """How the optimizer DeepSpeed built keeps each trainable parameter's fp32 master and Adam state:
    ``mapped`` (ZeRO-1/2/3, ``BF16_Optimizer``: DeepSpeed's ``safe_*_full_*`` accessors), ``unfused``
    (``FP16_UnfusedOptimizer``, fp16 or bf16 at P = 1 without ZeRO: one fp32 master per parameter),
    ``plain`` (the torch optimizer holds the model's own fp32 parameters) or ``other`` (a wrapper
    mmpipe cannot read by parameter, e.g. the fused ``FP16_Optimizer`` a DeepSpeed ``FusedAdam``
    gets)."""
    import torch
    name = type(ds_optimizer).__name__
    if name in ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "BF16_Optimizer"):
        return "mapped"
    if name == "FP16_UnfusedOptimizer":
        return "unfused"
    return "plain" if isinstance(ds_optimizer, torch.optim.Optimizer) else "other"


def unfused_masters(ds_optimizer) -> dict:
    """``FP16_UnfusedOptimizer``: id(model parameter) -> its fp32 master, the tensor the inner torch
    optimizer steps and keys its Adam state by (``fp16_groups[i][j]`` <-> ``fp32_groups[i][j]``)."""
    return {id(p): m for lp, hp in zip(ds_optimizer.fp16_groups, ds_optimizer.fp32_groups) for p, m in zip(lp, hp)}


def set_zero3_partition(param, full) -> None:
    """Write this rank's partition of a ZeRO-3 parameter (``param.ds_tensor``, the flat slice
    ``rank x numel`` of the padded parameter over ``param.ds_process_group``) from its full value:
    ``safe_set_full_fp32_param`` sets only the optimizer's fp32 partition, and the forward reads
    this one."""
    import torch
    import torch.distributed as dist
    part = param.ds_tensor
    n = part.numel()
    start = dist.get_rank(group=param.ds_process_group) * n
    flat = full.detach().flatten()[start:start + n]
    with torch.no_grad():
        part.data.zero_()
        part.data[:flat.numel()].copy_(flat.to(part.dtype))


def is_zero3_param(param) -> bool:
    """Whether ZeRO-3 partitions ``param`` (``partition_parameters.Init`` gives it a ``ds_id``): its
    value is then ``set_zero3_partition``'s to write."""
    return hasattr(param, "ds_id")


def set_engine_step(engine, step: int) -> None:
    """Put a ``DeepSpeedEngine``'s own counters (``global_steps``, ``global_samples``) at ``step``, as
    if it had trained that far: a resume that did not load DeepSpeed's files (another layout)."""
    engine.global_steps = step
    engine.global_samples = step * engine.train_batch_size()


def fix_fp16_backward_scaling() -> bool:
    """DeepSpeed 0.19.8's ``DeepSpeedEngine.backward`` multiplies the loss by the loss scale only for
    a ZeRO optimizer, while ``FP16_UnfusedOptimizer`` / ``FP16_Optimizer`` (fp16 at ZeRO-0; mmpipe's
    torch AdamW gets the unfused one) still divide the gradients by it in ``step()``: every update
    is ``cur_scale`` times too small, nothing can overflow, and clipping never engages (measured on
    an H100, BENCHMARKS.md; deepspeedai/DeepSpeed PR #8393). Scale the loss as their own
    ``backward()`` does, at class level so the pipeline engine's ``super().backward`` gets it too.
    Idempotent; stands aside when the installed engine already scales for them. True if patched."""
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine
    original = DeepSpeedEngine.backward
    if getattr(original, "_mmpipe_fp16_scaling", False):
        return True
    if "FP16_UnfusedOptimizer" in inspect.getsource(original):  # fixed upstream
        return False
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    def backward(self, loss, *args, **kwargs):
        opt = self.optimizer
        if isinstance(opt, (FP16_Optimizer, FP16_UnfusedOptimizer)):
            if getattr(opt, "custom_loss_scaler", False):
                loss = opt.external_loss_scale * loss
            elif opt.loss_scale_config.use_grad_scaling:
                loss = loss.float() * opt.loss_scale_config.cur_scale
        return original(self, loss, *args, **kwargs)

    backward._mmpipe_fp16_scaling = True
    DeepSpeedEngine.backward = backward
    return True


def one_read_overflow_check() -> bool:
    """``CheckOverflow.has_overflow_serial`` (what ``FP16_UnfusedOptimizer.step`` calls, fp16 and bf16
    at ZeRO-0 without a pipeline) tests one gradient at a time, each test a host read: ~300 device
    synchronisations a step for a CLIP ViT-B/16 (measured on an H100 with ``log.profile``,
    BENCHMARKS.md). The same answer (is any element of any gradient inf or NaN) from every
    gradient's max-magnitude (``_foreach_norm`` with ord inf: inf for an inf, NaN for a NaN, finite
    otherwise, never an overflow of its own), read once. Idempotent; True if patched."""
    import torch
    from deepspeed.runtime.utils import CheckOverflow
    if getattr(CheckOverflow.has_overflow_serial, "_mmpipe_one_read", False):
        return True

    def has_overflow_serial(self, params):
        grads = [p.grad.data for p in params if p.grad is not None]
        if not grads:
            return False
        peaks = torch._foreach_norm(grads, float("inf"), dtype=torch.float32)
        return not bool(torch.isfinite(torch.stack(peaks)).all())

    has_overflow_serial._mmpipe_one_read = True
    CheckOverflow.has_overflow_serial = has_overflow_serial
    return True


def foreach_unfused_step() -> bool:
    """``FP16_UnfusedOptimizer.step`` (bf16 / fp16 at ZeRO-0 without a pipeline) loops over the
    parameters: each gradient's norm (for a clip mmpipe does not ask of it: ``gradient_clipping`` is
    0 below ZeRO-2), its fp32 copy, its unscale (a multiply by 1 in bf16), the master's copy back:
    ~5 kernels per parameter, ~1,000 a step for a CLIP ViT-B/16 (``log.profile`` on an H100,
    BENCHMARKS.md). The same step with multi-tensor (``_foreach``) operations: one copy into fp32,
    the unscale only when the scale is not 1, one copy back; the global norm DeepSpeed records is
    kept on the device (no host read). With a DeepSpeed clip (``clip_grad`` > 0) or the legacy
    fused LAMB, DeepSpeed's own step runs. Same values: a copy is a copy, and x * 1 is x. (DeepSpeed
    also skipped a step whose gradients were all finite but whose fp32 norm overflowed; that is left
    to mmpipe's clipper, which takes its norms in float64 and skips a step whose norm is not finite.)
    Idempotent; True if patched."""
    import torch
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    original = FP16_UnfusedOptimizer.step
    if getattr(original, "_mmpipe_foreach", False):
        return True

    def step(self, closure=None):
        if self.fused_lamb_legacy or self.clip_grad > 0:
            return original(self, closure)
        self.overflow = self.overflow_checker.check()
        if self.overflow:
            return self._skip_invalid_grad_norm()
        pairs = [(fp32_param, fp16_param) for fp32_group, fp16_group in zip(self.fp32_groups, self.fp16_groups)
                 for fp32_param, fp16_param in zip(fp32_group, fp16_group)]
        have = [(a, b) for a, b in pairs if b.grad is not None]
        norms = []
        if have:  # the fp32 gradients: views of one buffer (one allocation, freed with them after the step)
            flat = torch.empty(sum(a.numel() for a, _ in have), dtype=have[0][0].dtype, device=have[0][0].device)
            for (a, _), view in zip(have, torch.split(flat, [a.numel() for a, _ in have])):
                a.grad = view.view(a.shape)
            torch._foreach_copy_([a.grad for a, _ in have], [b.grad for _, b in have])
            norms = torch._foreach_norm([a.grad for a, _ in have])
        for a, b in pairs:
            if b.grad is None:  # (as DeepSpeed: a zero gradient, so Adam still steps it)
                a.grad = torch.zeros_like(a)
        self._global_grad_norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else 0.0
        self._update_scale(False)
        scale = self.loss_scale_config.cur_scale
        fp32_grads = [p.grad for group in self.fp32_groups for p in group]
        if scale != 1.0 and fp32_grads:
            torch._foreach_mul_(fp32_grads, 1.0 / scale)
        self.optimizer.step()
        low, high = [], []
        for fp32_group, fp16_group in zip(self.fp32_groups, self.fp16_groups):
            for fp32_param, fp16_param in zip(fp32_group, fp16_group):
                fp32_param.grad = None
                low.append(fp16_param.data)
                high.append(fp32_param.data)
        if low:
            torch._foreach_copy_(low, high)
        return self.overflow

    step._mmpipe_foreach = True
    step._mmpipe_original = original
    FP16_UnfusedOptimizer.step = step
    return True


def no_single_rank_allreduce(engine) -> bool:
    """A ZeRO-0 engine without a pipeline whose data-parallel group is this rank alone still
    all-reduces after every backward: the gradients flattened into one buffer, "all-reduced",
    divided by 1 and copied back one by one (a kernel per parameter per step). Off when it is the
    identity; ZeRO and pipeline engines reduce by their own paths and are left alone. True if
    switched off."""
    if engine.zero_optimization_stage() != 0 or getattr(engine, "pipeline_parallelism", False):
        return False
    if engine.dp_world_size != 1:
        return False
    engine.enable_backward_allreduce = False
    return True


@contextlib.contextmanager
def no_initial_unfused_step():
    """While DeepSpeed builds its optimizer: ``FP16_UnfusedOptimizer`` (bf16 / fp16 at ZeRO-0 without a
    pipeline; mmpipe's torch AdamW gets the unfused one) calls ``initialize_optimizer_states()`` in its
    constructor, one ``optimizer.step()`` on zero gradients, so torch's AdamW counts a step before
    training starts (every bias correction one step off: the first update 0.74x the intended one at
    betas 0.9/0.98) and applies weight decay once. Torch's optimizers create their state on the first
    real step (and a resume restores it), so the constructor's step is left out."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    original = FP16_UnfusedOptimizer.initialize_optimizer_states
    FP16_UnfusedOptimizer.initialize_optimizer_states = lambda self: None
    try:
        yield
    finally:
        FP16_UnfusedOptimizer.initialize_optimizer_states = original


def dynamic_loss_scale(ds_optimizer):
    """The fp16 loss scale DeepSpeed's optimizer wrapper uses now, None without loss scaling
    (fp32, bf16) or with a static scale."""
    cfg = getattr(ds_optimizer, "loss_scale_config", None)  # FP16_Optimizer, FP16_UnfusedOptimizer
    if cfg is not None:
        return float(cfg.cur_scale) if getattr(cfg, "dynamic_loss_scale", False) else None
    scaler = getattr(ds_optimizer, "loss_scaler", None)  # DeepSpeedZeroOptimizer
    if scaler is not None and getattr(scaler, "dynamic", False):
        return float(scaler.cur_scale)
    return None


# ---- expert parallelism: mmpipe's expert slices as DeepSpeed's MoE parameters ------------------------------------
def create_expert_groups(expert_parallel: int, pipeline_stages: int) -> tuple:
    """DeepSpeed's expert-parallel and expert-data-parallel groups for ``expert_parallel`` consecutive data-parallel
    ranks of each stage (the pipe-major rank layout of ``PipeDataParallelTopology``; ``pp_size`` given: before
    ``initialize`` DeepSpeed has no mpu to read it from). A collective: every rank calls it. Returns (the
    expert-parallel group, this rank's place in it, DeepSpeed's group name ``ep_size_N``)."""
    from deepspeed.utils import groups
    groups._create_expert_and_data_parallel(expert_parallel, mp_size=1, pp_size=pipeline_stages)
    name = f"ep_size_{expert_parallel}"
    return groups._get_expert_parallel_group(name), groups._get_expert_parallel_rank(name), name


@contextlib.contextmanager
def moe_engine():
    """While DeepSpeed builds an engine: a model holding expert parameters (``allreduce = False`` with a
    ``group_name``: DeepSpeed's own mark) counts as a MoE model (``has_moe_layers``) though it has no
    ``deepspeed.moe`` layer, so the engine reduces their gradients over the expert-data-parallel group (averaged by
    the data-parallel degree: ``_reduce_expert_gradients``) and its ZeRO / bf16 optimizers partition them there (when
    some train: frozen slices are only broadcast over their group, which DeepSpeed does by the mark alone); set
    right after the model is placed and broadcast (which already sends expert parameters over their group), before
    the optimizer is built."""
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.runtime.engine import DeepSpeedEngine
    original = DeepSpeedEngine._configure_distributed_model

    def configure(self, model):
        original(self, model)
        if any(is_moe_param(p) and p.requires_grad for p in self.module.parameters()):  # (frozen slices, e.g.
            self.has_moe_layers = True  # LoRA's: no expert optimizer group, nothing to reduce; broadcast as marked)

    DeepSpeedEngine._configure_distributed_model = configure
    try:
        yield
    finally:
        DeepSpeedEngine._configure_distributed_model = original


def expert_parallel_group(engine):
    """The expert-parallel group of an engine over expert slices (``moe_engine``), None without one."""
    if not getattr(engine, "has_moe_layers", False):
        return None
    groups = getattr(engine, "expert_parallel_group", None) or {}
    return next(iter(groups.values()), None)


def expert_param_groups(torch_groups: list) -> list:
    """Each optimizer group's expert parameters moved into a sibling group DeepSpeed treats as MoE (``moe: True``,
    ``name``: the parameters' expert group name, which its ZeRO optimizer partitions over), mmpipe's own group name
    kept under ``mmpipe_name`` (clipping, logging: ``group_name``); other groups as they are."""
    from deepspeed.moe.utils import is_moe_param
    out, experts = [], []
    for g in torch_groups:
        mine = [p for p in g["params"] if is_moe_param(p)]
        rest = [p for p in g["params"] if not is_moe_param(p)]
        if rest or not mine:  # (a group of experts only is not left empty: DeepSpeed's ZeRO and bf16 optimizers
            out.append({**g, "params": rest} if mine else g)  # index a group's first parameter)
        for name in sorted({p.group_name for p in mine}):
            experts.append({**g, "params": [p for p in mine if p.group_name == name], "moe": True, "name": name,
                            "mmpipe_name": g.get("name")})
    return out + experts


def group_name(g: dict):
    """mmpipe's name of an optimizer group (``expert_param_groups`` renames an expert group for DeepSpeed)."""
    return g.get("mmpipe_name", g.get("name"))


@contextlib.contextmanager
def without_moe_checkpoint(engine):
    """``engine.save_checkpoint`` in DeepSpeed's plain format: its MoE format saves experts per ``deepspeed.moe``
    layer (none here) and leaves the per-stage model files out; mmpipe writes every expert slice itself."""
    moe = getattr(engine, "has_moe_layers", False)
    engine.has_moe_layers = False
    try:
        yield
    finally:
        engine.has_moe_layers = moe
