"""One test per DeepSpeed patch in ``mmpipe.parallel.ds_compat``: each fails when the installed
DeepSpeed no longer has the private API the patch relies on (read from DeepSpeed's own classes and
source). What each patch does is exercised by the run tests named in its docstring."""
from __future__ import annotations

import contextlib
import inspect

import pytest


def _src(obj) -> str:
    return inspect.getsource(obj)


def test_checked_range_covers_the_installed_deepspeed():
    import deepspeed
    from packaging.version import Version

    from mmpipe.parallel.ds_compat import CHECKED
    assert Version(CHECKED[0]) <= Version(deepspeed.__version__.split("+")[0]) <= Version(CHECKED[1])


def test_fix_recv_buffer_dtype_targets_exist():
    """Behaviour: test_parity.py::test_layout_parity[p3] (int ids and float grads share buffers)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    params = list(inspect.signature(PipelineEngine._allocate_or_extend_buffers).parameters)
    assert params[1:4] == ["idx", "shape", "dtype"]
    alloc = inspect.signature(PipelineEngine._allocate_buffer).parameters
    assert "num_buffers" in alloc and "kwargs" in alloc  # dtype travels in **kwargs to _allocate_zeros
    assert "dtype" in inspect.signature(PipelineEngine._allocate_zeros).parameters or \
        "kwargs" in inspect.signature(PipelineEngine._allocate_zeros).parameters
    assert "self._grad_layer_buf" in _src(PipelineEngine._allocate_or_extend_buffers)
    # the engine calls it through the instance attribute, so an instance-level wrapper takes effect
    assert "self._allocate_or_extend_buffers(" in _src(PipelineEngine)


def test_instruction_map_is_what_the_schedule_dispatches_through():
    """Behaviour: test_balance_runs.py::test_stage_time_is_accounted_and_the_trace_is_written."""
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine
    table = PipelineEngine._INSTRUCTION_MAP
    assert isinstance(table, dict) and schedule.ForwardPass in table and schedule.OptimizerStep in table
    assert all(callable(fn) for fn in table.values())
    assert "self._INSTRUCTION_MAP[type(cmd)]" in _src(PipelineEngine._exec_schedule)


def test_the_last_stage_backpropagates_the_engines_loss_attribute():
    """``loss_per_buffer``: the last stage's forward sets ``self.loss`` and its backward reads it back (so a
    buffer's own loss put there is the one backpropagated). Behaviour: test_schedule_contract.py::
    test_gpipe_trains_as_1f1b."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    assert "self.loss = self.module.loss_fn(outputs, labels)" in _src(PipelineEngine._exec_forward_pass)
    assert "super().backward(self.loss)" in _src(PipelineEngine._exec_backward_pass)


def test_a_stream_becomes_the_engines_train_schedule():
    """``set_train_schedule``: ``train_batch`` asks the instance for its schedule, and the installed one yields
    DeepSpeed's instruction for every action with the micro-batch's buffer (DeepSpeed's own TrainSchedule when
    the stream is ``1f1b``). Behaviour: test_schedule_contract.py (frozen_first runs)."""
    from types import SimpleNamespace

    from deepspeed.runtime.pipe import schedule as D
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from mmpipe.parallel.ds_compat import set_train_schedule
    from mmpipe.parallel.schedules import stream
    assert "self._train_schedule()" in _src(PipelineEngine.train_batch)
    for P, M, s in ((2, 4, 0), (3, 5, 1), (4, 8, 3)):
        engine = SimpleNamespace(micro_batches=M, num_stages=P, stage_id=s)
        set_train_schedule(engine, stream("1f1b", P, M, s))
        sched = engine._train_schedule()
        ours = [(type(c), c.kwargs) for step in sched for c in step]
        theirs = [(type(c), c.kwargs) for step in D.TrainSchedule(micro_batches=M, stages=P, stage_id=s) for c in step]
        assert ours == theirs and sched.num_pipe_buffers() == D.TrainSchedule(M, P, s).num_pipe_buffers()


def test_zero_optimizer_step_and_group_gradients():
    """Behaviour: test_groups.py (grouped clipping at P = 2 x DP = 2 with ZeRO-1)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    assert DeepSpeedZeroOptimizer.__name__ == "DeepSpeedZeroOptimizer"  # is_zero_optimizer matches by name
    assert len(inspect.signature(DeepSpeedZeroOptimizer._get_preflattened_grad_partition).parameters) == 2  # (self, i)
    assert "self.averaged_gradients" in _src(DeepSpeedZeroOptimizer)
    step_src = _src(DeepSpeedZeroOptimizer.step)
    # the inner optimizer is stepped group by group inside step(), each group's gradient freed after
    # it: a hook must run before step() to see every group's gradient
    assert "for i, group in enumerate(self.bit16_groups)" in step_src and "self._optimizer_step(i)" in step_src
    assert "self.averaged_gradients[i] = None" in step_src


def test_eval_batch_accumulates_into_total_loss():
    """Behaviour: test_parity.py::test_resume_reproduces_straight_run (eval right after a step)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    assert "self.total_loss" in _src(PipelineEngine._exec_forward_pass)
    assert "self.total_loss = None" not in _src(PipelineEngine.eval_batch)  # why mmpipe resets it


def test_pipeline_module_partition_hooks():
    """Behaviour: every explicit placement (test_parity.py, test_balance_runs.py)."""
    from deepspeed.runtime.pipe.module import PipelineModule
    assert list(inspect.signature(PipelineModule._set_bounds).parameters)[1:3] == ["start", "stop"]
    assert "self._partition_layers(" in _src(PipelineModule.__init__)
    assert "self._topo" in _src(PipelineModule.__init__) and "self.global_rank" in _src(PipelineModule.__init__)


def test_newer_deepspeed_warns(monkeypatch):
    import deepspeed

    from mmpipe.parallel import ds_compat
    monkeypatch.setattr(deepspeed, "__version__", "99.0.0")
    with pytest.warns(UserWarning, match="checked on"):
        ds_compat.check_version()


def test_unfused_fp16_optimizer_keeps_one_master_per_parameter():
    """Behaviour: test_resume_matrix.py (bf16 at P = 1 is FP16_UnfusedOptimizer, resumed elsewhere)."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    init = _src(FP16_UnfusedOptimizer.__init__)
    assert "self.fp16_groups.append(trainable)" in init and "self.fp32_groups.append(fp32_group)" in init
    assert "param_group['params'] = self.fp32_groups[i]" in init  # the inner optimizer steps the masters


def test_zero3_partition_and_state_targets_exist():
    """Behaviour: test_resume_matrix.py::...[bf16-none-P1-DP2Z3]."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    src = _src(DeepSpeedZeroOptimizer_Stage3)
    assert "self.fp32_partitioned_groups_flat" in src and "self.optimizer.state[fp32_param][optim_state_key]" in src
    from deepspeed.runtime.zero.partition_parameters import Init
    assert "param.ds_tensor" in _src(Init) and "ds_process_group" in _src(Init)


def test_fp16_backward_scaling_patch_applies_while_deepspeed_misses_it():
    """DeepSpeed 0.19.8 scales the loss in ``DeepSpeedEngine.backward`` only for ZeRO optimizers; the
    fp16 optimizers of ZeRO-0 still unscale in ``step()``. Measured on a GPU (BENCHMARKS.md, fp16);
    fp16 does not run on this CPU. The patch wraps the engine's ``backward`` at class level, scaling
    as the optimizers' own ``backward()`` does, and the pipeline engine reaches it through super()."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from mmpipe.parallel.ds_compat import fix_fp16_backward_scaling
    own = _src(FP16_UnfusedOptimizer.backward)
    assert "self.loss_scale_config.cur_scale" in own and "self.loss_scale_config.use_grad_scaling" in own
    assert "self.custom_loss_scaler" in own and "self.external_loss_scale" in own
    assert "super().backward(self.loss" in _src(PipelineEngine._exec_backward_pass)
    original = DeepSpeedEngine.backward
    try:
        upstream_fixed = "FP16_UnfusedOptimizer" in _src(original)
        assert fix_fp16_backward_scaling() is not upstream_fixed
        if not upstream_fixed:
            assert getattr(DeepSpeedEngine.backward, "_mmpipe_fp16_scaling", False)
            patched = DeepSpeedEngine.backward
            assert fix_fp16_backward_scaling() and DeepSpeedEngine.backward is patched  # once
    finally:
        DeepSpeedEngine.backward = original


def test_the_unfused_optimizer_takes_no_step_before_training():
    """bf16 at P = 1 without ZeRO: DeepSpeed's FP16_UnfusedOptimizer constructor steps torch's AdamW once on
    zero gradients; ``no_initial_unfused_step`` leaves that step out while DeepSpeed builds it. Behaviour:
    test_lora.py's bf16 LoRA at P = 1 equals P = 2 (BF16_Optimizer, no such step)."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from mmpipe.parallel.ds_compat import no_initial_unfused_step
    assert "self.initialize_optimizer_states()" in _src(FP16_UnfusedOptimizer.__init__)
    assert "self.optimizer.step()" in _src(FP16_UnfusedOptimizer.initialize_optimizer_states)
    original = FP16_UnfusedOptimizer.initialize_optimizer_states
    with no_initial_unfused_step():
        assert FP16_UnfusedOptimizer.initialize_optimizer_states(object()) is None
    assert FP16_UnfusedOptimizer.initialize_optimizer_states is original


def test_one_read_overflow_check_gives_deepspeeds_answer():
    """``CheckOverflow.has_overflow_serial`` tested one gradient at a time (a host read each); the patch
    reads once and gives the same answer for finite, inf and NaN gradients, fp16 / bf16, large values
    (an fp32 sum of squares of finite bf16 values could overflow; a max-magnitude cannot)."""
    import torch
    from deepspeed.runtime.utils import CheckOverflow

    from mmpipe.parallel.ds_compat import one_read_overflow_check
    assert "self._has_inf_or_nan(p.grad.data, i)" in _src(CheckOverflow.has_overflow_serial) or \
        getattr(CheckOverflow.has_overflow_serial, "_mmpipe_one_read", False)
    original = CheckOverflow.has_overflow_serial

    def params(values, dtype):
        out = []
        for v in values:
            p = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
            p.grad = torch.tensor([1.0, v, -2.0], dtype=dtype)
            out.append(p)
        return out + [torch.nn.Parameter(torch.zeros(2, dtype=dtype))]  # one without a gradient
    cases = [(dt, vals) for dt in (torch.float16, torch.bfloat16)
             for vals in ([0.5, 3.0], [0.5, float("inf")], [float("nan"), 1.0], [float("-inf"), 1.0])]
    cases.append((torch.bfloat16, [1e30, -3e38]))
    try:
        expected = [original(CheckOverflow.__new__(CheckOverflow), params(v, dt)) for dt, v in cases]
        assert one_read_overflow_check() and one_read_overflow_check()
        got = [CheckOverflow.has_overflow_serial(CheckOverflow.__new__(CheckOverflow), params(v, dt)) for dt, v in cases]
    finally:
        CheckOverflow.has_overflow_serial = original
    assert got == expected and expected == [False, True, True, True] * 2 + [False]


# --------------------------------------------------------------------------------------------
def _bf16_engine(seed: int):
    """A one-rank DeepSpeed engine at bf16 without ZeRO (FP16_UnfusedOptimizer, torch AdamW) over 24
    small linear layers: 48 parameters."""
    import deepspeed
    import torch

    from mmpipe.parallel.startup import init_distributed
    init_distributed()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(24)])
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    from mmpipe.parallel.ds_compat import no_initial_unfused_step
    with no_initial_unfused_step():
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _train_counting(engine, steps: int = 3) -> int:
    """Train ``steps`` steps; the operations (not views) dispatched by the last backward and step."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                Count.n += 1
            return func(*args, **(kwargs or {}))
    g = torch.Generator().manual_seed(0)
    for i in range(steps):
        x = torch.randn(4, 8, generator=g).to(torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        with Count() if i == steps - 1 else contextlib.nullcontext():
            engine.backward(loss)
            engine.step()
    return Count.n


def test_foreach_unfused_step_and_no_single_rank_allreduce_train_as_deepspeed_does():
    """bf16 at P = 1 without ZeRO on one rank: DeepSpeed's own step and its identity all-reduce against
    ``foreach_unfused_step`` + ``no_single_rank_allreduce``: the same weights and fp32 masters bit for bit
    after three steps, and the patched backward + step dispatch a fixed handful of operations where
    DeepSpeed's dispatch several per parameter. Behaviour in runs: test_host_syncs.py (reads and
    operations per step of a tiny CLIP at bf16), test_resume_matrix.py (bf16 at P = 1)."""
    import torch
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from mmpipe.parallel import ds_compat
    assert "self.overflow_checker.check()" in _src(getattr(FP16_UnfusedOptimizer.step, "_mmpipe_original",
                                                           FP16_UnfusedOptimizer.step))
    patched = getattr(FP16_UnfusedOptimizer.step, "_mmpipe_foreach", False)
    original = getattr(FP16_UnfusedOptimizer.step, "_mmpipe_original", FP16_UnfusedOptimizer.step)
    FP16_UnfusedOptimizer.step = original
    try:
        theirs = _bf16_engine(1)
        assert theirs.enable_backward_allreduce and type(theirs.optimizer).__name__ == "FP16_UnfusedOptimizer"
        n_theirs = _train_counting(theirs)
        assert ds_compat.foreach_unfused_step() and ds_compat.foreach_unfused_step()
        ours = _bf16_engine(1)
        assert ds_compat.no_single_rank_allreduce(ours) and not ours.enable_backward_allreduce
        n_ours = _train_counting(ours)
    finally:
        if not patched:
            FP16_UnfusedOptimizer.step = original
    n_params = 48
    for a, b in zip(theirs.module.parameters(), ours.module.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(theirs.optimizer.fp32_groups[0], ours.optimizer.fp32_groups[0]):
        assert torch.equal(a, b)
    # (the backward's own autograd operations are the same on both sides)
    assert n_theirs - n_ours > 4 * n_params, (n_theirs, n_ours)


# the module docstring's table names every function of ds_compat, and only those
# --------------------------------------------------------------------------------------------
def table_names(doc: str) -> set:
    """The function names of the docstring table's first column (``name``, ``name``)."""
    import re
    rows = [line for line in doc.splitlines() if line.startswith("| ``")]
    return {n for row in rows for n in re.findall(r"``(\w+)``", row.split("|")[1])}


def defined_functions(source: str) -> set:
    """The public functions a module's source defines at top level."""
    import ast
    return {n.name for n in ast.parse(source).body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_")}


def table_mismatch(source: str) -> list:
    import ast
    listed, defined = table_names(ast.get_docstring(ast.parse(source)) or ""), defined_functions(source)
    return sorted([f"not in the table: {n}" for n in defined - listed]
                  + [f"no such function: {n}" for n in listed - defined])


def test_the_table_lists_every_function_and_only_functions():
    from mmpipe.parallel import ds_compat
    source = _src(ds_compat)
    # the check can fail: a function left out of the table, or a row naming a function that is gone
    planted = source + "\n\ndef planted_patch(engine):\n    engine._x = 1\n"
    assert table_mismatch(planted) == ["not in the table: planted_patch"]
    assert table_mismatch(source.replace("def reset_total_loss(", "def reset_total_loss_gone(")) == \
        ["no such function: reset_total_loss", "not in the table: reset_total_loss_gone"]
    assert len(table_names(ds_compat.__doc__)) >= 20
    assert table_mismatch(source) == []


def test_zero_optimizer_state_link_targets_exist():
    """Behaviour: test_resume_matrix.py (layout-free state saved and restored under ZeRO and bf16)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    for cls, flat in ((DeepSpeedZeroOptimizer, "self.single_partition_of_fp32_groups"),
                      (BF16_Optimizer, "self.fp32_groups_flat_partition")):
        src = _src(cls)
        assert flat in src and "self._hp_optimizer_states_linked" in src
        assert callable(getattr(cls, "_lazy_init_hp_params_optimizer_state", None))
        assert "if not self._hp_optimizer_states_linked" in _src(cls._lazy_init_hp_params_optimizer_state)


def test_cpu_shm_allreduce_is_built_through_the_module_function():
    """Behaviour: every CPU run (no /dev/shm buffer left behind, test_cpu_process.py)."""
    import importlib
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    assert callable(ds_torch.build_shm_op) and "build_shm_op()" in _src(ds_torch.TorchBackend.__init__)


def test_eval_batch_puts_the_module_in_eval_mode_through_its_method():
    """Behaviour: test_parity.py (the step loss's first pass in training mode)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    assert "self.module.eval()" in _src(PipelineEngine.eval_batch)


def test_pipeline_module_layers_and_grid():
    """Behaviour: test_parity.py (explicit boundaries; weights tied across stages at P = 2 x DP = 2)."""
    from deepspeed.runtime.pipe.module import PipelineModule
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid
    init = _src(PipelineModule.__init__)
    assert "self._layer_specs = list(layers)" in init and "self._grid = " in init
    assert "self.forward_funcs" in _src(PipelineModule._build) and "self.forward_funcs" in _src(PipelineModule.forward)
    assert "self.data_parallel_size" in _src(PipelineParallelGrid.__init__)
    assert list(inspect.signature(PipelineParallelGrid.stage_to_global).parameters)[:2] == ["self", "stage_id"]


def test_engine_counters_and_zero3_parameter_mark():
    """Behaviour: test_resume_matrix.py (a resume in another layout continues at the checkpoint's step,
    ZeRO-3 weights restored by name)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.partition_parameters import Init
    init = _src(DeepSpeedEngine.__init__)
    assert "self.global_steps = 0" in init and "self.global_samples = 0" in init
    assert "self.global_steps += 1" in _src(DeepSpeedEngine) and "self.global_samples += " in _src(DeepSpeedEngine)
    assert "param.ds_id" in _src(Init)


def test_engine_counters_are_set_as_a_trained_engine_holds_them():
    from mmpipe.parallel.ds_compat import is_zero3_param, set_engine_step, stage_global_ranks

    class Engine:
        def train_batch_size(self):
            return 8

    eng = Engine()
    set_engine_step(eng, 5)
    assert (eng.global_steps, eng.global_samples) == (5, 40)

    class Param:
        pass
    p = Param()
    assert not is_zero3_param(p)
    p.ds_id = 3
    assert is_zero3_param(p)

    class Grid:
        data_parallel_size = 2

        def stage_to_global(self, stage_id, data):
            return stage_id * 2 + data

    class Module:
        _grid = Grid()
    assert stage_global_ranks(Module(), 1) == [2, 3]


def test_optim_fused_reaches_torchs_fused_adamw_which_trains_alike(tmp_path):
    """``optim.fused`` goes through mmpipe's DeepSpeed config to ``torch.optim.AdamW(fused=True)`` under DeepSpeed's
    bf16 wrapper, and three steps train the fp32 masters as torch's default step does (within float rounding). Unset,
    it is on for CUDA/XPU and off here; a DeepSpeed JSON's ``foreach: true`` beside ``optim.fused=true`` is one line."""
    import json

    import deepspeed
    import torch
    from helpers import TINY

    import mmpipe
    from mmpipe.config.deepspeed import adamw_kernel, fused_adamw, resolve
    from mmpipe.errors import ConfigError
    from mmpipe.parallel.ds_compat import no_initial_unfused_step
    from mmpipe.parallel.startup import init_distributed
    init_distributed()
    sets = ["train.precision=bf16", "parallel.pipeline_stages=1", "train.batch_size=4", "parallel.micro_batch_size=4"]
    unset, off, on = (mmpipe.load_config(TINY, sets + extra) for extra in ([], ["optim.fused=false"], ["optim.fused=true"]))
    assert not fused_adamw(unset)  # this process's accelerator is the CPU
    assert [adamw_kernel(unset, gpu=True), adamw_kernel(off, gpu=True), adamw_kernel(unset, gpu=False),
            adamw_kernel(on, gpu=False)] == ["fused", "foreach", "single", "fused"]
    masters = {}
    for fused, cfg in ((True, on), (False, unset)):
        ds, _ = resolve(cfg, 1)
        assert ds["optimizer"]["params"].get("fused", False) is fused
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
        with no_initial_unfused_step():
            engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)
        assert bool(engine.optimizer.optimizer.defaults["fused"]) is fused
        assert type(engine.optimizer).__name__ == "FP16_UnfusedOptimizer"
        torch.manual_seed(1)
        for _ in range(3):
            engine.backward(engine(torch.randn(4, 64, dtype=torch.bfloat16)).float().pow(2).mean())
            engine.step()
        masters[fused] = [p.detach().clone() for p in engine.optimizer.fp32_groups[0]]
    for a, b in zip(masters[True], masters[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    js = tmp_path / "ds.json"
    js.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"torch_adam": True, "foreach": True}}}))
    with pytest.raises(ConfigError, match="optim.fused=true and .*foreach=true"):
        resolve(mmpipe.load_config(TINY, sets + ["optim.fused=true", f"train.deepspeed_config={js}"]), 1)
    assert "fused" not in resolve(mmpipe.load_config(TINY, sets + [f"train.deepspeed_config={js}"]), 1)[0][
        "optimizer"]["params"]


def test_the_step_temporaries_the_memory_model_prices_are_what_each_adamw_kernel_makes():
    """New storages counted live in one AdamW step of 16 x 64 x 64 parameters (those it steps in place, and their
    state, registered first): the multi-tensor kernel (CUDA's default) makes an fp32 temporary per parameter, the
    fused one none, the per-parameter loop (the CPU's default) a few of one parameter's at a time - the
    ``adamw_temp`` the memory model prices per kernel (``config.deepspeed.adamw_kernel``: 4, 0, 0)."""
    import torch

    from mmpipe.parallel.live_bytes import LiveBytes
    from mmpipe.planning.memory import RunShape, adamw_temp_bytes, stage_breakdown
    from mmpipe.planning.place import layer_costs
    made = {}
    for kernel, kw in (("foreach", {"foreach": True}), ("fused", {"fused": True}), ("single", {"foreach": False})):
        params = [torch.randn(64, 64, requires_grad=True) for _ in range(16)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3, **kw)
        opt.step()  # Adam's state exists
        with LiveBytes() as live:
            for t in params + [p.grad for p in params] + [v for st in opt.state.values() for v in st.values()]:
                live.add(t, "held")
            live.reset_peak()
            opt.step()
        made[kernel] = live.peak - live.at_peak.get("held", 0)
    n = 16 * 64 * 64
    assert made["foreach"] >= 4 * n and made["fused"] < 0.05 * 4 * n and made["single"] <= 4 * (4 * 64 * 64), made
    # the memory model's step moment for each kernel: what it made, within a few of one parameter's temporaries
    costs = layer_costs({"layers": [dict(name="a", fwd_ms=1.0, bwd_ms=1.0, act_bytes=0, out_bytes=0, param_bytes=0,
                                         params=n, trainable=n)]})
    for kernel, bytes_made in made.items():
        step = stage_breakdown(costs, [0, 1], 1, "fp32", shape=RunShape(adamw_temp=adamw_temp_bytes(kernel)))[0]
        assert abs(step.step_workspace - bytes_made) <= 4 * (4 * 64 * 64), (kernel, step.step_workspace, bytes_made)


def test_a_resume_keeps_the_runs_adamw_kernel():
    """torch's ``load_state_dict`` takes the saved groups' ``fused`` / ``foreach``: a checkpoint of a foreach run
    would step a fused run's optimizer with the foreach kernel. ``checkpoint.keep_adamw_kernel`` keeps the run's,
    and moves each ``step`` counter where that kernel reads it (float32; the parameter's device for fused)."""
    import torch

    from mmpipe.train.checkpoint import keep_adamw_kernel

    def stepped(**kw):
        params = [torch.randn(8, 8, requires_grad=True) for _ in range(3)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3, **kw)
        opt.step()
        return opt
    saved = stepped(foreach=True).state_dict()
    plain = stepped(fused=True)
    plain.load_state_dict(saved)
    assert not plain.param_groups[0]["fused"]  # torch's own behaviour, which the next lines undo
    opt = stepped(fused=True)
    keep_adamw_kernel(opt, lambda: opt.load_state_dict(saved))
    assert opt.param_groups[0]["fused"] and not opt.param_groups[0]["foreach"]
    for p in opt.param_groups[0]["params"]:
        step = opt.state[p]["step"]
        assert step.dtype == torch.float32 and step.device == p.device and float(step) == 1.0
    opt.step()


def test_a_stage_with_several_outputs_walks_its_graph_once():
    """``one_backward``: DeepSpeed's non-last stage calls ``out.backward`` once per float output it sent (two walks
    back through a layer both outputs depend on); patched, DeepSpeed's own ``_exec_backward_pass`` walks it once
    and every gradient is the same. Behaviour in runs: test_qwen_moe.py (the router statistics beside the hidden
    states), test_qwen3_vl.py (DeepStack's features)."""
    from types import SimpleNamespace

    import torch
    from deepspeed.runtime.pipe import schedule as S
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from mmpipe.parallel.ds_compat import one_backward
    assert "out.backward(gradient=grad, retain_graph=" in _src(PipelineEngine._exec_backward_pass)

    class Counted(torch.autograd.Function):
        calls = 0

        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            Counted.calls += 1
            return g * 2

    def run(patched: bool):
        torch.manual_seed(0)
        w = torch.randn(4, 4, requires_grad=True)
        x = torch.randn(3, 4)
        h = Counted.apply(x @ w)  # both outputs depend on it
        outputs = (h.tanh(), (h * h).sum(0), torch.arange(3))  # two float outputs and an integer one
        engine = SimpleNamespace(
            _INSTRUCTION_MAP={S.BackwardPass: PipelineEngine._exec_backward_pass}, optimizer=object(),
            is_last_stage=lambda: False, pipe_buffers={"outputs": [outputs], "output_tensors": [None]},
            wall_clock_breakdown=lambda: False, is_pipe_partitioned=False, is_grad_partitioned=False,
            grad_layer=(torch.ones(3, 4), torch.full((4,), 0.5)), using_bf16_optimizer=False,
            _running_engine_backward=False)
        if patched:
            one_backward(engine)
        Counted.calls = 0
        engine._INSTRUCTION_MAP[S.BackwardPass](engine, 0)
        return Counted.calls, w.grad
    calls, grad = run(False)
    assert calls == 2  # the check can fail: DeepSpeed's loop walks the shared layer twice
    once, same = run(True)
    assert once == 1
    torch.testing.assert_close(same, grad, rtol=1e-6, atol=1e-6)


def test_expert_parallel_targets_exist_and_groups_split_as_deepspeed_reads_them():
    """Expert parallelism leans on DeepSpeed's MoE path: its group builder takes the pipeline degree, the engine
    reduces ``allreduce = False`` parameters over their expert-data-parallel group when ``has_moe_layers``, its ZeRO
    optimizer keys a MoE group's process group by the group's ``name``, an already split list of groups passes its
    splitter untouched, and ``save_checkpoint`` branches on ``has_moe_layers`` (the run tests: test_qwen_moe.py's
    expert-parallel layouts)."""
    import inspect

    import torch
    from deepspeed.moe.utils import configure_moe_param_groups, is_moe_param
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils import groups

    from mmpipe.parallel.ds_compat import expert_param_groups, group_name
    assert {"mp_size", "pp_size"} <= set(inspect.signature(groups._create_expert_and_data_parallel).parameters)
    assert callable(groups._get_expert_parallel_group) and callable(groups._get_expert_parallel_rank)
    assert "self.has_moe_layers = True" in inspect.getsource(DeepSpeedEngine._configure_distributed_model)
    assert "expert_grads[param.group_name]" in inspect.getsource(DeepSpeedEngine._get_gradients_for_reduction)
    assert "if self.has_moe_layers:" in inspect.getsource(DeepSpeedEngine.save_checkpoint)
    assert "self.expert_dp_process_group[group['name']]" in inspect.getsource(DeepSpeedZeroOptimizer._configure_moe_settings)
    dense, expert = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, 2))
    expert.allreduce, expert.group_name = False, "ep_size_2"
    assert is_moe_param(expert) and not is_moe_param(dense)
    split = expert_param_groups([{"name": "llm", "params": [dense, expert], "lr": 0.1}])
    assert [(group_name(g), g.get("name"), g.get("moe", False), len(g["params"])) for g in split] == \
        [("llm", "llm", False, 1), ("llm", "ep_size_2", True, 1)]
    assert split[1]["lr"] == 0.1 and configure_moe_param_groups(split) is split
