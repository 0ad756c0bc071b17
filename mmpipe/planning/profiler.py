"""Per-layer costs of the pipeline layers, measured on real batches in one process.

Every pipeline layer is run the way a pipeline stage runs it: its float inputs detached (as if
received from the previous stage), forward, then backward from the gradient of its outputs. That
gives, per layer and micro-batch shape:
- ``fwd_ms`` / ``bwd_ms``: median wall time after warm-up (synchronised on accelerators), each
  pass timed cache-cold, as it runs inside a pipeline stage (``CacheEvictor``);
  a frozen layer with nothing trainable upstream runs forward only (no autograd graph at all),
  a frozen layer after a trainable one still pays the backward through its activations;
- ``act_bytes``: memory autograd keeps for backward (saved tensors, counted once per storage,
  parameters excluded) plus the layer's inputs (a stage keeps them per micro-batch in flight);
- ``out_bytes``: size of what the layer hands on (the send/receive volume at a stage boundary);
- ``param_bytes`` / ``trainable``: weights held, and how many of them train;
- ``w_bytes``: what a split backward (``parallel.zero_bubble``) queues for the weight gradients of its trainable
  ``nn.Linear`` layers (each one's input and output gradient) between ``B`` and ``W``; with ``split``, ``bwd_in_ms``
  / ``bwd_w_ms``: the two halves timed apart (``B``: the input gradient and the rest; ``W``: the deferred weight
  gradients).

``mmpipe.planning.memory`` turns these into a per-stage peak for a layout (weights, gradients,
optimizer state, activations times the micro-batches in flight under 1F1B, checkpointed or not).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from mmpipe.families.expert_dispatch import is_fused_experts
from mmpipe.parallel.executor import wants_grad
from mmpipe.parallel.live_bytes import LiveBytes
from mmpipe.parallel.zero_bubble import WeightGradStore, install


@dataclass
class LayerCost:
    name: str
    fwd_ms: float
    bwd_ms: float
    act_bytes: int
    out_bytes: int
    param_bytes: int
    params: int
    trainable: int
    opt_ms: float = 0.0
    # what crosses a stage boundary after this layer: DeepSpeed sends each tensor of the tuple as its
    # own message (activations), and one gradient message per float tensor that wants one
    out_tensors: int = 1
    grad_tensors: int = 1
    grad_bytes: Optional[int] = None  # bytes of those gradients (None: ``out_bytes``)
    in_bytes: Optional[int] = None  # the layer's input (what it keeps per micro-batch when checkpointed)
    workspace: int = 0  # bytes its backward needs beyond what it saved and its parameters' gradients
    w_bytes: int = 0  # a split backward's queue between B and W (its trainable linear layers' inputs and outputs)
    bwd_in_ms: Optional[float] = None  # a split backward's B (None: not measured; ``bwd_ms`` is the whole)
    bwd_w_ms: Optional[float] = None  # ... and its W
    # a MoE layer: its routed experts' parameters (split over parallel.expert_parallel ranks: ``memory``), and the
    # bytes of the token rows its experts take per micro-batch (tokens x top-k x hidden: what expert parallelism's
    # all-to-all sends out and back, forward and backward)
    experts: int = 0
    experts_trainable: int = 0
    routed_bytes: int = 0

    def backward_split(self) -> tuple:
        """(B, W) milliseconds: measured, else the whole backward in B."""
        if self.bwd_in_ms is None or self.bwd_w_ms is None:
            return self.bwd_ms, 0.0
        return self.bwd_in_ms, self.bwd_w_ms

    def to_dict(self) -> dict:
        return asdict(self)

    def static_bytes(self, per_trainable: float, per_frozen: float) -> float:
        """Weights, gradients and optimizer state this layer holds (see ``bytes_per_param``)."""
        return self.trainable * per_trainable + (self.params - self.trainable) * per_frozen


def _sync(device) -> None:
    if device.type != "cpu":
        from deepspeed.accelerator import get_accelerator
        get_accelerator().synchronize()


def _nbytes(acts) -> int:
    if torch.is_tensor(acts):
        return acts.numel() * acts.element_size()
    return sum(t.numel() * t.element_size() for t in acts if torch.is_tensor(t))


def _detach(acts, grad_flags=None):
    """Inputs as a stage receives them: detached; float ones require a gradient unless the layer
    that made them was a forward-only layer's sink (then, as in a run, nothing upstream trains)."""
    ts = [acts] if torch.is_tensor(acts) else list(acts)
    flags = grad_flags or [t.is_floating_point() for t in ts]
    out = [_marked(t, t.detach().requires_grad_(bool(f) and t.is_floating_point())) for t, f in zip(ts, flags)]
    return out[0] if torch.is_tensor(acts) else tuple(out)


def _marked(src: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new`` with what mmpipe recorded on ``src`` (``_mmpipe_*`` attributes: a mask's kind, a meta
    tensor's host values), as a stage keeps them on the tensors it passes on."""
    new.__dict__.update({k: v for k, v in src.__dict__.items() if k.startswith("_mmpipe_")})
    return new


class _SavedBytes:
    """Bytes autograd saves for backward inside the context, once per storage, parameters excluded."""

    def __init__(self, exclude_ptrs: set, already_counted: set):
        self.exclude, self.seen, self.total = exclude_ptrs, set(already_counted), 0

    def pack(self, t):
        try:
            st = t.untyped_storage()
            ptr = st._cdata  # the storage itself (a data pointer is 0 for every meta tensor)
            if ptr not in self.exclude and ptr not in self.seen:
                self.seen.add(ptr)
                self.total += st.nbytes()
        except (RuntimeError, NotImplementedError):  # e.g. sparse / meta tensors
            pass
        return t

    @staticmethod
    def unpack(t):
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def last_level_cache_bytes(device) -> int:
    """Size of the device's last-level cache: the CPU's largest cache level (sysfs), an accelerator's
    L2 (device properties); 64 MiB where neither says."""
    if device.type == "cpu":
        import glob
        best = 0
        for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
            try:
                with open(f"{d}/size") as fh:
                    txt = fh.read().strip().upper()
            except OSError:
                continue
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(txt[-1:], 1)
            best = max(best, int(txt.rstrip("KMG") or 0) * mult)
        return best or 64 * 2**20
    props = getattr(getattr(torch, device.type, None), "get_device_properties", None)
    size = getattr(props(device), "L2_cache_size", 0) if props else 0
    return int(size) or 64 * 2**20


class CacheEvictor:
    """Writes a buffer twice the last-level cache before each timed pass, so a layer is timed with
    its weights, saved activations and gradients coming from memory, as they do in a run: between
    two passes of one layer a pipeline stage runs its other layers and micro-batches, and the
    neighbouring stages on the same socket share that cache (triton's ``do_bench`` flushes the L2
    before each timing for the same reason). Measured here: a 4-block text stage ran 6.0 ms forward /
    9.1 ms backward warm and 9.2 / 12.6 ms after eviction; inside a 2-stage run it took 10.4 / 12.9."""

    def __init__(self, device):
        self.buf = torch.empty(2 * last_level_cache_bytes(device) // 4, dtype=torch.float32, device=device)

    def __call__(self) -> None:
        self.buf.fill_(1.0)
        _sync(self.buf.device)


def profile_layers(layers, inputs: tuple, repeats: int = 5, warmup: int = 2,
                   timed: bool = True, cold: bool = True, n_layers: Optional[int] = None,
                   loss_fn: Optional[Callable] = None, workspace: bool = True, split: bool = False) -> list[LayerCost]:
    """Costs of ``layers`` (PipeLayers on their device and dtype; a list, or an iterator that builds
    them one at a time) for one micro-batch ``inputs``.

    Layers are profiled one after another: a layer's forward and backward (from an all-ones
    gradient on its float outputs - the time does not depend on the values) run on the previous
    layer's detached output, so only one layer's weights and activations are alive at a time and a
    model larger than one device can still be profiled layer by layer. ``cold``: each pass is
    timed after evicting the caches (``CacheEvictor``). ``loss_fn``: the loss the last stage computes
    on the last layer's outputs (a family with label fields), run as part of the last of the
    ``n_layers`` layers: its saved tensors and working set are the last stage's too. ``workspace``:
    count each layer's working set (a further forward and backward; bytes do not change between
    passes, so a repeated profile counts them once). ``split``: also time the backward split (``B``, ``W``)."""
    device = inputs[0].device
    evict = CacheEvictor(device) if (cold and timed) else (lambda: None)
    rounds = (warmup + repeats) if timed else 1
    keep = slice(warmup, None) if timed else slice(0, None)
    costs = []
    x = inputs
    # which float inputs want a gradient: all of the model's inputs, then what the previous layer's
    # outputs want (round 0 measures bytes, what a stage boundary sends back and the working set so).
    # Except in the first layer's later (timed) rounds: the engine never computes the model inputs'
    # gradient (DeepSpeed's first stage loads them without one), and a patch embedding's pixel
    # gradient was 300 of the 318 ms a Qwen2.5-VL patch embedding was priced on a CPU.
    flags = None
    no_grad_inputs = [False] * (1 if torch.is_tensor(inputs) else len(inputs))
    for i, layer in enumerate(layers):
        ptrs = {p.untyped_storage()._cdata for p in layer.parameters()}
        fwd, bwd, halves = [], [], []
        act = out_b = in_b = w_b = 0
        y, store = None, WeightGradStore()
        splits = split and timed and install(layer, store) > 0
        for r in range(rounds):
            y = None  # free the previous round's graph first
            x_in = _detach(x, no_grad_inputs if (i == 0 and r > 0) else flags)
            in_ptrs = {t.untyped_storage()._cdata for t in ([x_in] if torch.is_tensor(x_in) else x_in)}
            evict()
            t0 = time.perf_counter()
            run = _WithLoss(layer, loss_fn if i == (n_layers or 0) - 1 else None)
            with _SavedBytes(ptrs, in_ptrs) as saved, _LinearIO(layer, r == 0) as linear_io, \
                    _RoutedRows(layer, r == 0) as routed:
                y = run(x_in)
            _sync(device)
            fwd.append(time.perf_counter() - t0)
            if r == 0:
                in_b, w_b = _nbytes(x_in), linear_io.total
                act, out_b = saved.total + in_b, run.out_bytes or _nbytes(y)
                sent = [t for t in ([y] if torch.is_tensor(y) else y) if torch.is_tensor(t)]
                back = [t for t in sent if wants_grad(t)]
                next_flags = [wants_grad(t) for t in ([y] if torch.is_tensor(y) else list(y))]
            outs = [o for o in ([y] if torch.is_tensor(y) else y)
                    if torch.is_tensor(o) and o.is_floating_point() and o.grad_fn is not None]
            evict()
            t0 = time.perf_counter()
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            _sync(device)
            bwd.append(time.perf_counter() - t0)
            if splits:
                halves.append(_split_backward(run, _detach(x, no_grad_inputs if (i == 0 and r > 0) else flags), store,
                                              evict, device))
        layer.zero_grad(set_to_none=True)
        params = list(layer.parameters())
        costs.append(LayerCost(
            name=getattr(layer, "name", str(i)),
            fwd_ms=1e3 * statistics.median(fwd[keep]), bwd_ms=1e3 * statistics.median(bwd[keep]),
            act_bytes=act, out_bytes=out_b,
            param_bytes=sum(p.numel() * p.element_size() for p in params),
            params=sum(p.numel() for p in params), trainable=sum(p.numel() for p in params if p.requires_grad),
            opt_ms=optimizer_ms(layer, repeats if timed else 0, evict),
            out_tensors=len(sent), grad_tensors=len(back), grad_bytes=_nbytes(back), in_bytes=in_b,
            workspace=backward_workspace(run, _detach(x, flags), layer) if workspace else 0, w_bytes=w_b,
            **_experts(layer, routed.total), **_halves(halves[keep], split, bwd[keep])))
        ys = [y] if torch.is_tensor(y) else list(y)
        flags = next_flags
        x = _marked(ys[0], ys[0].detach()) if torch.is_tensor(y) else tuple(_marked(t, t.detach()) for t in ys)
        del layer, y, ys, params
    return costs


def _experts(layer, routed_bytes: int) -> dict:
    """A layer's ``LayerCost`` fields of its routed experts."""
    ps = [p for m in layer.modules() if is_fused_experts(m) for p in m.parameters(recurse=False)]
    return {"experts": sum(p.numel() for p in ps), "experts_trainable": sum(p.numel() for p in ps if p.requires_grad),
            "routed_bytes": routed_bytes}


class _RoutedRows:
    """Bytes of the token rows a layer's fused experts take in one forward (hidden states x top-k: what expert
    parallelism's all-to-all sends each way); on the meta device too."""

    def __init__(self, layer, on: bool):
        self.layer, self.on, self.total, self.handles = layer, on, 0, []

    def _count(self, module, args):
        hidden, top_k_index = args[0], args[1]
        self.total += hidden.numel() * top_k_index.shape[-1] * hidden.element_size()

    def __enter__(self):
        if self.on:
            self.handles = [m.register_forward_pre_hook(self._count) for m in self.layer.modules() if is_fused_experts(m)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


class _LinearIO:
    """Bytes of the inputs and outputs of a layer's trainable ``nn.Linear`` modules in one forward (what a split
    backward queues for their weight gradients: the input, and an output gradient of the output's size); on the
    meta device too."""

    def __init__(self, layer, on: bool):
        self.layer, self.on, self.total, self.handles = layer, on, 0, []

    def _count(self, module, args, out):
        if torch.is_grad_enabled() and module.weight.requires_grad:
            self.total += _nbytes(args[0]) + _nbytes(out)

    def __enter__(self):
        if self.on:
            self.handles = [m.register_forward_hook(self._count) for m in self.layer.modules()
                            if isinstance(m, torch.nn.Linear)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _halves(halves: list, split: bool, bwd: list) -> dict:
    """``bwd_in_ms`` / ``bwd_w_ms`` of a layer: the medians of its timed (B, W) seconds; nothing deferred, the
    whole backward is B; not measured (``split`` off): None."""
    if halves:
        return {"bwd_in_ms": 1e3 * statistics.median(h[0] for h in halves),
                "bwd_w_ms": 1e3 * statistics.median(h[1] for h in halves)}
    return {"bwd_in_ms": 1e3 * statistics.median(bwd), "bwd_w_ms": 0.0} if split else {}


def _split_backward(run, x_in, store, evict, device) -> tuple:
    """(B seconds, W seconds) of one micro-batch through ``run`` as a split-backward order runs it."""
    with store.step():
        y = run(x_in)
        outs = [o for o in ([y] if torch.is_tensor(y) else y)
                if torch.is_tensor(o) and o.is_floating_point() and o.grad_fn is not None]
        evict()
        t0 = time.perf_counter()
        with store.backward_input(0):
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        _sync(device)
        t1 = time.perf_counter()
        evict()
        t2 = time.perf_counter()
        store.weight_gradients(0)
        _sync(device)
        return t1 - t0, time.perf_counter() - t2


class _WithLoss:
    """A layer followed by the loss on its outputs; ``out_bytes``: the layer's outputs (the last
    stage keeps them per micro-batch, DeepSpeed's ``outputs`` buffer)."""

    def __init__(self, layer, loss_fn):
        self.layer, self.loss_fn, self.out_bytes = layer, loss_fn, 0

    def __call__(self, x):
        y = self.layer(x)
        if self.loss_fn is None:
            return y
        self.out_bytes = _nbytes(y)
        return self.loss_fn(y)


def backward_workspace(run, x_in, layer) -> int:
    """Peak bytes a layer's forward and backward hold beyond its saved tensors and its parameters'
    gradients (the gradients of its intermediate tensors, attention scores...), counted
    (``LiveBytes``) over one forward and backward: the peak, less what was alive when the forward
    ended, less the gradients."""
    counter = LiveBytes()
    with counter:
        y = run(x_in)
        outs = [o for o in ([y] if torch.is_tensor(y) else y)
                if torch.is_tensor(o) and o.is_floating_point() and o.grad_fn is not None]
        before = counter.total
        counter.reset_peak()
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    grads = sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
    layer.zero_grad(set_to_none=True)
    return max(0, int(counter.peak - before - grads))


TIMES = ("fwd_ms", "bwd_ms", "opt_ms", "bwd_in_ms", "bwd_w_ms")


def _times(cs, combine) -> dict:
    return {k: combine([getattr(c, k) for c in cs]) for k in TIMES if all(getattr(c, k) is not None for c in cs)}


def median_costs(runs: list) -> list[LayerCost]:
    """One cost per layer from several profiling passes: each time the median over the passes."""
    from dataclasses import replace
    return [replace(cs[0], **_times(cs, statistics.median)) for cs in zip(*runs)]


def mixed_costs(shapes: list) -> list[LayerCost]:
    """One cost per layer from the profiles of several micro-batch shapes (``[(weight, costs)]``: the
    family's ``example_batches``): times the weighted mean (what a step costs on average), bytes the
    largest (a stage must hold the largest shape's activations)."""
    from dataclasses import replace
    total = sum(w for w, _ in shapes)
    out = []
    for cs in zip(*(costs for _, costs in shapes)):
        times = _times(cs, lambda v: sum(w * x for (w, _), x in zip(shapes, v)) / total)
        sizes = {k: max(getattr(c, k) for c in cs) for k in ("act_bytes", "out_bytes", "workspace", "w_bytes")}
        for k in ("in_bytes", "grad_bytes"):
            vals = [getattr(c, k) for c in cs if getattr(c, k) is not None]
            sizes[k] = max(vals) if vals else None
        out.append(replace(cs[0], **times, **sizes))
    return out


def optimizer_ms(layer, repeats: int, evict: Callable[[], None] = lambda: None) -> float:
    """Median time of one AdamW step over the layer's trainable parameters (0 if none, or untimed),
    each after ``evict()``."""
    params = [p for p in layer.parameters() if p.requires_grad]
    if not params or repeats <= 0:
        return 0.0
    master = [p.detach().float().clone().requires_grad_(True) for p in params]  # the fp32 copy an optimizer steps
    for m in master:
        m.grad = torch.randn_like(m) * 1e-3
    opt = torch.optim.AdamW(master, lr=1e-4)
    times = []
    for _ in range(repeats + 1):
        evict()
        _sync(master[0].device)
        t0 = time.perf_counter()
        opt.step()
        _sync(master[0].device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[1:])


