"""Layer profiles: a family's layers built one at a time and timed on its example batches
(``get_profile``, cached by everything it depends on) or sized on the meta device
(``meta_profile``), with what a run does beyond forward and backward (``_with_schedule``: a step
loss, activation checkpointing, tied layers) and the stage-to-stage transfer model. Planning
outside a run is ``mmpipe.planning.offline``."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Callable, Optional

import torch

from mmpipe.config.deepspeed import adamw_kernel
from mmpipe.config.fields import thawed_copy
from mmpipe.data.json_files import write_json
from mmpipe.parallel.cpu_process import keep_freed_memory
from mmpipe.parallel.layers import PipeLayer, plain_state_key
from mmpipe.parallel.schedules import Order, candidates
from mmpipe.parallel.step_loss import frozen_prefix
from mmpipe.planning.cache import cache_dir
from mmpipe.planning.collectives import fit_comm, measure_p2p
from mmpipe.planning.memory import STEP_LOSS_BLOCK_PAIR_BYTES, STEP_LOSS_PAIR_BYTES, adamw_temp_bytes
from mmpipe.planning.place import layer_costs
from mmpipe.planning.profiler import median_costs, mixed_costs, profile_layers


def precision_dtype(precision: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def iter_layers(family, forward_only: frozenset = frozenset(), frozen_params: frozenset = frozenset(),
                device: Optional[torch.device] = None, dtype: torch.dtype = torch.float32):
    """The model's pipeline layers, built one at a time (seeded per part: the pipeline's weights;
    on the meta device: shapes only, nothing allocated), in training mode, with frozen parameters
    marked."""
    meta = device is not None and torch.device(device).type == "meta"
    for name in family.layer_names():
        if meta:
            with torch.device("meta"):
                layer = PipeLayer(family, name, name in forward_only).to(dtype=dtype)
        else:
            layer = PipeLayer(family, name, name in forward_only).to(device=device, dtype=dtype)
        for k, p in layer.named_parameters():
            if plain_state_key(name, k) in frozen_params:
                p.requires_grad_(False)
        yield layer.train()


def build_layers(family, forward_only: frozenset = frozenset(), frozen_params: frozenset = frozenset(),
                 device: Optional[torch.device] = None, dtype: torch.dtype = torch.float32) -> list:
    """Every pipeline layer of the model at once, in one process."""
    return list(iter_layers(family, forward_only, frozen_params, device, dtype))


# ---- profiles for planning ----------------------------------------------------------------------
def profile_key(cfg, family, micro_batch_size: int, threads: int, device: str, forward_only, frozen) -> dict:
    """What a layer profile depends on, as plain values in a fixed order (one key in every process)."""
    import deepspeed
    return {"model": cfg.to_dict()["model"], "family": family.name,
            "micro_batch_size": micro_batch_size, "max_length": cfg.data.max_length, "packing": cfg.data.packing,
            "lora": family.lora.canonical() if family.lora is not None else None,
            "precision": cfg.train.precision,
            "device": device, "threads": threads, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "forward_only": sorted(forward_only),
            "frozen": hashlib.sha1("\n".join(sorted(frozen)).encode()).hexdigest(), "version": 16,
            "split_backward": split_backward(cfg),
            # a chat family's example shapes may come from its data (``example_batches``: image sizes)
            "data": _data_key(cfg.data.train) if family.data_format == "chat" else None,
            # a CPU profile is timed as a rank computes, with or without mmpipe's malloc settings
            "cpu_malloc": device != "cpu" or os.environ.get("MMPIPE_CPU_MALLOC", "").lower() != "default"}


def split_backward(cfg) -> bool:
    """Whether the profile times each layer's backward split (``B``, ``W``) too: the run may take a split-backward
    order (``parallel.schedule`` asks for one, or ``auto`` weighs one at P >= 2)."""
    name, P = cfg.parallel.schedule, cfg.parallel.pipeline_stages
    if name == "auto":
        return P > 1 and any(o.splits_backward() for o in candidates(P, 0))
    return Order(name).splits_backward()


def profile_digest(key: dict) -> str:
    """The cache file's name of a profile key."""
    return hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _data_key(path) -> Optional[list]:
    """A data file as a profile depends on it: its path and modification time."""
    return [path, os.path.getmtime(path)] if path and os.path.isfile(path) else None


def synthetic_batch(family, m: int, max_length: int, device, with_loss: bool = False, packed: bool = False,
                    b: Optional[dict] = None):
    """A micro-batch of the configured shape (timing does not depend on the pixels or words); with
    ``with_loss``, also the loss the last stage computes on the last layer's outputs (None when the
    last layer computes it). ``packed`` (``data.packing``): rows of several samples, as a packed run
    feeds them (its attention takes the block-diagonal mask). ``b``: one of the family's
    ``example_batches`` instead of its ``example_batch``."""
    b = b if b is not None else family.example_batch(m, max_length, device, packed=packed)
    inputs = tuple(b[f] for f in family.inputs)
    if not with_loss:
        return inputs
    labels = tuple(b[f] for f in family.labels)
    return inputs, ((lambda out: family.loss(out, *labels)) if family.labels else None)


def get_profile(cfg, family, micro_batch_size: int, forward_only: frozenset = frozenset(),
                frozen: frozenset = frozenset(), threads: Optional[int] = None, repeats: int = 5,
                use_cache: bool = True, measure_comm: bool = True, log: Optional[Callable[[str], None]] = None,
                refresh: bool = False, passes: Optional[int] = None,
                run_micro_batches: Optional[float] = None) -> dict:
    """Per-layer costs at the run's micro-batch shape, precision, device and threads per rank, plus
    the stage-to-stage transfer model; cached as JSON keyed by all of these.

    ``passes``: the layers are profiled this many times over and each layer keeps its median (3 on
    a CPU, 1 on an accelerator): a shared CPU has slowdowns lasting seconds - one single-pass profile
    here came out 30% slow while the next three agreed within 8%. ``run_micro_batches``: the micro-batches
    one rank of the run computes (steps x micro-batches per step / stages): the profile's cost is bounded
    against that run (``PROFILE_SHARE``), by fewer passes and timed rounds, said in the log."""

    from deepspeed.accelerator import get_accelerator
    device = torch.device(get_accelerator().device_name())
    threads = threads or torch.get_num_threads()
    key = profile_key(cfg, family, micro_batch_size, threads, device.type, forward_only, frozen)
    digest = profile_digest(key)
    path = os.path.join(cache_dir(), f"{digest}.json")
    if use_cache and not refresh and os.path.isfile(path):
        with open(path) as fh:
            prof = json.load(fh)
        if log:
            log(f"reusing the cached layer profile of this model, shapes and threads: {path} (delete it to "
                "measure again)")
        if measure_comm and not prof["comm"].get("measured"):  # cached without transfers: measure them now
            prof["comm"] = _measure_comm(layer_costs(prof))
            write_json(path, prof)
        if family.step_loss and "loss_pair_s" not in prof:  # cached before the step loss was timed
            prof["loss_pair_s"] = _time_loss_pair(family, prof, device, threads)
            write_json(path, prof)
        return _with_schedule(prof, family, cfg)
    shapes = family.example_batches(micro_batch_size, cfg.data.max_length, device, packed=cfg.data.packing,
                                     data_cfg=cfg.data)
    if log:
        log(f"profiling {len(family.layer_names())} layers at {len(shapes)} micro-batch shape(s) (micro-batch "
            f"{micro_batch_size}, {cfg.train.precision}, {device.type}, {threads} thread(s)); cached for the next run "
            f"in {path} ...")
    if device.type == "cpu":  # as a training rank computes (mmpipe.parallel.cpu_process)
        keep_freed_memory()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        costs, passes = _profile_shapes(cfg, family, micro_batch_size, forward_only, frozen, device, shapes,
                                        repeats, passes or (3 if device.type == "cpu" else 1), run_micro_batches, log,
                                        split_backward(cfg))
    finally:
        torch.set_num_threads(old)
    comm = _measure_comm(costs) if measure_comm else {"latency_s": 0.0, "s_per_byte": 0.0, "samples": {},
                                                       "measured": False}
    prof = {"key": key, "layers": [c.to_dict() for c in costs], "comm": comm, "passes": passes}
    if family.step_loss:
        prof["loss_pair_s"] = _time_loss_pair(family, prof, device, threads)
    if use_cache:
        write_json(path, prof)
    return _with_schedule(prof, family, cfg)


PROFILE_SHARE = 0.1  # a profile's timed passes take at most about this share of the run they plan (past the first)


def _profile_shapes(cfg, family, mbs: int, forward_only, frozen, device, shapes: list, repeats: int, passes: int,
                    run_micro_batches: Optional[float], log, split: bool = False) -> tuple:
    """(costs, passes) of the family's example shapes (``[(weight, batch)]``): each timed shape ``passes``
    times (the median per layer), a weight-0 shape (memory only) once, one round; progress per shape (and a
    bar per layer with ``log.progress``). After the first timed pass, the rest is cut to fit ``PROFILE_SHARE``
    of ``run_micro_batches`` micro-batches at the measured speed: fewer passes, then fewer timed rounds."""
    import time

    n_layers, dtype = len(family.layer_names()), precision_dtype(cfg.train.precision)
    timed = sum(1 for w, _ in shapes if w > 0)
    bar = _progress_bar(cfg, n_layers * (timed * passes + len(shapes) - timed))
    warmup, out, seen, first = 2, [], 0, None
    try:
        for k, (weight, b) in enumerate(shapes):
            batch, loss_fn = synthetic_batch(family, mbs, cfg.data.max_length, device, with_loss=True, b=b)
            runs, t0 = [], time.perf_counter()
            while len(runs) < (passes if weight > 0 else 1):  # (``passes`` may be cut after the first timed pass)
                i = len(runs)
                layers = _counted(iter_layers(family, forward_only, frozen, device, dtype), bar,
                                  f"profile shape {k + 1}/{len(shapes)}")
                runs.append(profile_layers(layers, batch, repeats=repeats if weight > 0 else 1,
                                           warmup=warmup if weight > 0 else 0, n_layers=n_layers, loss_fn=loss_fn,
                                           workspace=i == 0, split=split and weight > 0))
                if weight > 0:
                    seen += 1
                if weight > 0 and first is None:  # the first timed pass prices the rest against the run
                    first = time.perf_counter() - t0
                    passes, repeats, warmup, why = _bounded(first, runs[0], timed * passes - 1, passes, repeats,
                                                            warmup, run_micro_batches)
                    if why and log:
                        log(f"profile bounded to {PROFILE_SHARE:.0%} of the run it plans: {why}")
                    if why and bar is not None:  # the passes left
                        memory_only = sum(1 for w, _ in shapes[k + 1:] if w == 0)
                        bar.total = bar.n + n_layers * (passes - 1 + passes * (timed - 1) + memory_only)
                        bar.refresh()
            out.append((weight, median_costs(runs)))
            if log:
                log(f"profiled shape {k + 1}/{len(shapes)} ({'memory only' if weight == 0 else f'weight {weight:.2f}'}"
                    f", {len(runs)} pass(es)) in {time.perf_counter() - t0:.0f} s")
    finally:
        if bar is not None:
            bar.close()
    return mixed_costs(out), passes


def _bounded(first_s: float, costs: list, left: int, passes: int, repeats: int, warmup: int,
             run_micro_batches: Optional[float]) -> tuple:
    """(passes, repeats, warmup, why): the remaining ``left`` timed passes (each ~``first_s``) cut to about
    ``PROFILE_SHARE`` of the run (``run_micro_batches`` at the pass's measured forward + backward)."""
    if not run_micro_batches or left <= 0:
        return passes, repeats, warmup, ""
    budget = PROFILE_SHARE * run_micro_batches * sum(c.fwd_ms + c.bwd_ms for c in costs) / 1e3
    if first_s * left <= budget:
        return passes, repeats, warmup, ""
    shapes = max(1, round((left + 1) / passes))  # the timed shapes
    p = max(1, min(passes, int(budget / (first_s * shapes))))
    rounds = warmup + repeats
    if first_s * (shapes * p - 1) > budget:  # one pass each is still over: fewer timed rounds (1 warm-up, 2 timed)
        warmup, repeats = 1, 2
    why = (f"{p} pass(es) a shape (was {passes}), {warmup} warm-up + {repeats} timed rounds a layer (was {rounds}): "
           f"{first_s:.0f} s a pass against about {run_micro_batches * sum(c.fwd_ms + c.bwd_ms for c in costs) / 1e3:.0f}"
           " s of the run's own compute")
    return p, repeats, warmup, why


def _progress_bar(cfg, total: int):
    if not cfg.log.progress:
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="layer", desc="profile", leave=False)


def _counted(layers, bar, desc: str):
    for layer in layers:
        yield layer
        if bar is not None:
            bar.set_description(desc)
            bar.update(1)


META_PARAMS = 100_000_000  # above this, ``mmpipe plan`` sizes the model on the meta device


def parameter_count(family) -> int:
    """The model's parameters, counted on the meta device."""
    n = 0
    for name in family.layer_names():
        with torch.device("meta"):
            n += sum(p.numel() for p in family.build_unseeded(name).parameters())
    return n


@contextlib.contextmanager
def fused_attention_on_meta():
    """``scaled_dot_product_attention`` on meta tensors as a fused kernel runs it: on the meta
    device sdpa has no kernel choice and decomposes into matmul + softmax, which would save the
    T x T attention weights for backward; a fused (flash) kernel saves the inputs, the output and
    the log-sum-exp, as it does on a GPU and on this CPU (whose profile the meta one matches)."""
    import torch.nn.functional as F
    original = F.scaled_dot_product_attention

    class NativeGQA(torch.autograd.Function):
        """sdpa with ``enable_gqa`` (transformers passes it when there is no mask): the fused kernel
        keeps the key/value heads as they are, so what backward saves is q, k, v unrepeated, the
        output and the log-sum-exp (shapes only: this runs on meta tensors)."""

        @staticmethod
        def forward(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale):
            rep = q.shape[-3] // k.shape[-3]
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3), dropout_p, is_causal,
                attn_mask=attn_mask, scale=scale)[:2]
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):
            q, k, v, _, _ = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None, None, None

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not q.is_meta:
            return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                            enable_gqa=enable_gqa)
        if k.shape[-3] != q.shape[-3]:
            if enable_gqa:
                return NativeGQA.apply(q, k, v, attn_mask, dropout_p, is_causal, scale)
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)  # as many key/value heads as queries
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def fused_dropout_kernel() -> bool:
    """Whether the accelerator's ``dropout`` is the fused kernel: on CUDA (and XPU, and out-of-tree
    devices) ``aten::dropout`` runs ``native_dropout``, whose backward keeps a one-byte boolean mask;
    on the CPU, MPS (and the meta device) it multiplies by a noise tensor of the input's dtype, which
    backward keeps whole (torch's ``is_fused_kernel_acceptable``, aten/src/ATen/native/Dropout.cpp)."""
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().device_name() not in ("cpu", "mps")


@contextlib.contextmanager
def dropout_on_meta(fused: bool):
    """``dropout`` on meta tensors as the run's device runs it (``fused_dropout_kernel``): with
    ``fused``, ``native_dropout`` (a boolean mask kept for backward: a byte per element, where the
    meta device's own path keeps two for bf16, four for fp32). LoRA's dropout on every adapted
    linear's input is ~12% of a LLaVA-7B LoRA run's saved activations, so this is the difference between
    sizing a GPU run and sizing this CPU's."""
    import torch.nn.functional as F
    original = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if fused and input.is_meta and training and 0 < p < 1 and input.numel() and not inplace:
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)
    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original


def meta_profile(cfg, family, micro_batch_size: int, forward_only: frozenset = frozenset(),
                 frozen: frozenset = frozenset(), gpu_kernels: Optional[bool] = None) -> dict:
    """Bytes-only layer profile of the model built on the meta device: every layer's parameters,
    saved activations, inputs, outputs and backward working set from shapes (a forward and backward
    on meta tensors: no weight is allocated, no arithmetic runs), in seconds for a model this
    machine cannot hold; attention and dropout as this process's accelerator runs them
    (``fused_attention_on_meta``, ``dropout_on_meta``), or a GPU (``gpu_kernels``: a plan made on a
    CPU host for GPUs). No times: ``timed`` is False, and what reads it says so."""
    device = torch.device("meta")
    data = thawed_copy(cfg.data)
    data.train = None  # (the budgets alone: a plan for another machine need not read its data)
    shapes = family.example_batches(micro_batch_size, cfg.data.max_length, device, packed=cfg.data.packing,
                                    data_cfg=data)
    worst = max((b for _, b in shapes), key=lambda b: sum(t.numel() for t in b.values() if torch.is_tensor(t)))
    batch, loss_fn = synthetic_batch(family, micro_batch_size, cfg.data.max_length, device, with_loss=True,
                                     packed=cfg.data.packing, b=worst)
    gpu = fused_dropout_kernel() if gpu_kernels is None else gpu_kernels
    with fused_attention_on_meta(), dropout_on_meta(gpu):
        costs = profile_layers(iter_layers(family, forward_only, frozen, device, precision_dtype(cfg.train.precision)),
                               batch, timed=False, n_layers=len(family.layer_names()), loss_fn=loss_fn)
    key = {"family": family.name, "micro_batch_size": micro_batch_size, "max_length": cfg.data.max_length,
           "precision": cfg.train.precision, "device": "meta", "threads": 1, "forward_only": sorted(forward_only)}
    for c in costs:  # meta operations take no real time: no times at all, rather than noise
        c.fwd_ms = c.bwd_ms = c.opt_ms = 0.0
    prof = {"key": key, "layers": [c.to_dict() for c in costs], "timed": False,
            "comm": {"latency_s": 0.0, "s_per_byte": 0.0, "samples": {}, "measured": False}}
    return _with_schedule(prof, family, cfg, gpu_kernels)


def _with_schedule(prof: dict, family, cfg, gpu: Optional[bool] = None) -> dict:
    """What the run does beyond one forward and backward per micro-batch: a loss over the step
    (``_with_step_loss``) and activation checkpointing (``checkpointing``: every trained layer's
    forward runs again in its backward), so the predictions cost what runs."""
    prof["checkpointing"] = cfg.parallel.activation_checkpointing == "all"
    prof["adamw_temp"] = adamw_temp_bytes(adamw_kernel(cfg, gpu))  # (``gpu``: for a GPU run planned here)
    prof["expert_parallel"] = cfg.parallel.expert_parallel  # (the routed experts each rank holds)
    prof["ties"] = tied_layers(family)
    mbs = prof.get("key", {}).get("micro_batch_size")
    if mbs:  # one micro-batch as the loader hands it over (inputs and labels)
        b = family.example_batch(int(mbs), cfg.data.max_length, "meta")
        prof["batch_bytes"] = sum(t.numel() * t.element_size() for f in family.inputs + family.labels
                                  for t in ([b[f]] if torch.is_tensor(b[f]) else []))
        prof["last_reads"] = bool(family.labels)
    return _with_step_loss(prof, family)


def tied_layers(family) -> list:
    """[(layer, layer, elements)] per parameter the family ties between two layers (``tied_weights``):
    a stage holding both layers holds it once."""
    names = family.layer_names()

    def layer_of(param: str) -> str:
        return max((n for n in names if param.startswith(n + ".")), key=len)
    out = []
    for a, b in family.tied_weights():
        la, lb = layer_of(a), layer_of(b)
        with torch.device("meta"):
            part = family.build_unseeded(la)
        n = dict(part.named_parameters())[a[len(la) + 1:]].numel()
        out.append([la, lb, int(n)])
    return out


LOSS_PAIR_ROWS = 512  # ``_time_loss_pair``: a share of 256 rows against 512


def _time_loss_pair(family, prof: dict, device, threads: int) -> float:
    """Seconds per pair of the step loss (its value and every gradient, ``Family.batch_loss_grads``: a
    share of 256 rows against 512, the median of 3 after one warm-up) at the features' real width: what
    the layout chooser multiplies by each rank's rows x B."""
    import time
    mbs = int(prof.get("key", {}).get("micro_batch_size") or 1)
    widen = 1 if prof.get("key", {}).get("precision", "fp32") == "fp32" else 2
    width = max(2, widen * layer_costs(prof)[-2].out_bytes // (4 * mbs))  # fp32 elements per row
    name = family.layer_names()[-1]
    module = family.build_layer(name).to(device)
    params = [p for p in module.parameters() if p.requires_grad]
    feats = torch.randn(LOSS_PAIR_ROWS, width, device=device)
    rows = (0, LOSS_PAIR_ROWS // 2) if family.local_step_loss else None
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            out = family.batch_loss_grads(module, feats, params, rows=rows) if rows else \
                family.batch_loss_grads(module, feats[:LOSS_PAIR_ROWS // 2], params)
            float(out[0])  # (waits for the device)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    pairs = (LOSS_PAIR_ROWS // 2) * (LOSS_PAIR_ROWS if rows else LOSS_PAIR_ROWS // 2)
    return sorted(times[1:])[1] / pairs


def _with_step_loss(prof: dict, family) -> dict:
    """A family whose loss spans the step (``Family.step_loss``) runs a forward-only pass first and
    gathers the last layer's inputs (its features; fp32, one micro-batch's: ``features_bytes``)
    over the last stage's data-parallel group; its training pass skips the leading frozen layers
    (``frozen_prefix`` of them): the predictions cost what runs."""
    prof.pop("step_loss", None)
    if family.step_loss:
        widen = 1 if prof.get("key", {}).get("precision", "fp32") == "fp32" else 2  # features gathered in fp32
        forward_only = prof.get("key", {}).get("forward_only", [])
        prof["step_loss"] = {"features_bytes": widen * layer_costs(prof)[-2].out_bytes,
                             # leading layers run once per step (parallel.step_loss.FirstPassMemo)
                             "frozen_prefix": len(frozen_prefix(family.layer_names(), set(forward_only))),
                             # the batch loss's B x B transient: rows per micro-batch, bytes per pair
                             "rows": int(prof.get("key", {}).get("micro_batch_size") or 0),
                             "pair_bytes": int(family.step_loss_pair_bytes or STEP_LOSS_PAIR_BYTES),
                             "block_rows": int(family.step_loss_block_rows),
                             "block_pair_bytes": STEP_LOSS_BLOCK_PAIR_BYTES,
                             # with D > 1, each rank its own rows of the loss (model.local_loss)
                             "local": bool(family.local_step_loss),
                             # seconds per pair of the loss and its gradients (0: not timed)
                             "pair_s": float(prof.get("loss_pair_s", 0.0))}
    return prof


def _measure_comm(costs) -> dict:
    """Stage-to-stage transfer model (latency + bytes / bandwidth) fitted to p2p timings at the
    sizes the layers hand on; ``measured`` marks it, so a profile cached without it is completed."""
    sizes = sorted({c.out_bytes for c in costs[:-1]} | {4096})
    samples = measure_p2p(sizes)
    lat, spb = fit_comm(samples)
    return {"latency_s": lat, "s_per_byte": spb, "samples": {str(k): v for k, v in samples.items()}, "measured": True}


# ---- a run's memory --------------------------------------------------------------------------------
