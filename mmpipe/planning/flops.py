"""Analytic FLOPs of training, and the device peaks that make them MFU / HFU.

A family describes each layer's forward as matrix products (``Family.matmuls``: linear layers,
convolutions, attention's QK^T and AV as sdpa computes them, the LM head, contrastive logits) on a
micro-batch's real shape (``Family.micro_batch``); only those count (norms, activations, softmax
and losses are left out, as in every MFU convention). From them, per layer:

- forward: 2·m·k·n per product;
- backward, as autograd computes it: a weight's gradient (one more product) when the weight trains,
  an input's gradient when something before it trains (``Family.upstream``; a frozen layer with a
  trainable one before it still passes its gradient down), nothing for the forward-only frozen
  prefix; LoRA: the frozen base weight's input gradient plus the adapters' own products;
- model FLOPs = forward + backward; hardware FLOPs add the products run again: activation
  checkpointing's recompute (torch's stops at the last tensor backward needs: a block's last
  linear is not run again, ``Matmul.recomputed``), a step loss's first (feature) pass
  (``parallel.step_loss``), and attention's QK^T in sdpa's fused backward (``Matmul.rescored``).

Which parameters train and which layers run forward-only is the run's own layout
(``config.groups.frozen_layout``), the same that builds the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

from mmpipe.families.lora import ADAPTER, base_name, is_adapter, matches
from mmpipe.families.products import Matmul, MicroBatch


@dataclass(frozen=True)
class LayerFlops:
    """One layer's FLOPs on one micro-batch (see the module docstring)."""
    name: str
    forward: float
    backward: float
    recompute: float = 0.0  # products run again (checkpointing, a step loss's feature pass, attention's QK^T)

    @property
    def model(self) -> float:
        return self.forward + self.backward

    @property
    def hardware(self) -> float:
        return self.model + self.recompute


class Role(NamedTuple):
    """What decides a layer's backward: it runs forward-only; a layer before it trains (its input
    wants a gradient); it holds trainable parameters; ... other than LoRA adapters (its norms
    train); it recomputes its forward in backward (checkpointing); a step loss's feature pass runs
    it once more."""
    forward_only: bool
    upstream_trains: bool
    trains: bool
    trains_dense: bool
    checkpointed: bool = False
    feature_pass: bool = False


@dataclass(frozen=True)
class Training:
    """The roles of a run's layers, its frozen parameter names, every parameter name, the LoRA rank."""
    roles: dict
    frozen: frozenset
    params: frozenset
    lora_rank: int = 0
    lora_parameters: tuple = ()  # peft's target_parameters (a parameter LoRA folds its update into the weight)


def training(family, layout: tuple, checkpointing: bool = False, step_loss: Optional[bool] = None) -> Training:
    """The ``Training`` of ``family`` under ``layout`` (``config.groups.frozen_layout``: parameters
    per layer, frozen names, forward-only layers); ``checkpointing``: every layer that is not
    forward-only recomputes its forward in backward (``parallel.layers.set_activation_checkpointing``);
    ``step_loss`` (default: the family's): a feature pass runs those layers once more."""
    part_params, frozen, forward_only = layout
    trains = {la for la, names in part_params.items() if any(n not in frozen for n in names)}
    dense = {la for la, names in part_params.items() if any(n not in frozen and not is_adapter(n) for n in names)}
    step_loss = family.step_loss if step_loss is None else step_loss
    upstream = family.upstream()
    roles = {la: Role(la in forward_only, bool(upstream[la] & trains), la in trains, la in dense,
                      checkpointing and la not in forward_only, step_loss and la not in forward_only)
             for la in part_params}
    lora = family.lora
    return Training(roles, frozenset(frozen), frozenset(n for v in part_params.values() for n in v),
                    lora.rank if lora is not None else 0, lora.target_parameters if lora is not None else ())


def _param(layer: str, module: str, leaf: str) -> str:
    return ".".join(p for p in (layer, module, leaf) if p)


def product_flops(p: Matmul, layer: str, role: Role, t: Training) -> tuple:
    """(forward, backward) FLOPs of one product of ``layer`` (with its LoRA adapters, if any), and
    the products its backward runs again (``Matmul.rescored``)."""
    f = 2.0 * p.m * p.k * p.n
    if role.forward_only:
        return (f if p.forward else 0.0), 0.0, 0.0
    grad_in = role.upstream_trains or (role.trains_dense if p.depth == 1 else role.trains if p.depth >= 2 else False)
    if p.weight is None:  # a product of two activations: a gradient for both when they want one
        grads = 2 if p.grads is None else p.grads
        return (f if p.forward else 0.0), grads * f if grad_in else 0.0, f if grad_in and p.rescored else 0.0
    weight = _param(layer, p.weight, "base_layer.weight")
    adapted = weight in t.params
    if not adapted:
        weight = _param(layer, p.weight, "weight")
    if weight not in t.params and _param(layer, p.weight, "") in t.params:
        weight = _param(layer, p.weight, "")  # a parameter named itself (nn.MultiheadAttention's in_proj_weight)
    folded = False
    if weight not in t.params:  # a parameter LoRA (peft's target_parameters: a MoE's fused experts) wraps its module
        weight = next((n for n in t.params if base_name(n) == _param(layer, p.weight, "")), weight)
        # a targeted one has its update folded into the weight, which then takes a gradient
        folded = weight in t.params and matches(base_name(weight), t.lora_parameters)
    if weight not in t.params:
        raise KeyError(f"{layer}: no parameter {weight} for the product {p} (Family.matmuls names the module)")
    back = f * (int(grad_in) + int(folded or weight not in t.frozen))
    if adapted and _param(layer, p.weight, f"lora_A.{ADAPTER}.weight") in t.params:
        a, b = 2.0 * p.m * p.k * t.lora_rank, 2.0 * p.m * t.lora_rank * p.n  # x @ A, then @ B
        f += a + b
        back += a * (1 + int(grad_in)) + 2 * b  # both adapters' weight gradients; B's input gradient
    return f, back, 0.0


def layer_flops(family, mb: MicroBatch, t: Training) -> list:
    """``LayerFlops`` of every layer of ``family.layers()``, in order, on micro-batch ``mb``."""
    out = []
    for name in family.layer_names():
        role = t.roles[name]
        products = family.matmuls(name, mb)
        fb = [product_flops(p, name, role, t) for p in products]
        fwd, back, rescored = (sum(x[i] for x in fb) for i in range(3))
        again = sum(x[0] for x, p in zip(fb, products) if p.recomputed) if role.checkpointed else 0.0
        out.append(LayerFlops(name, fwd, back, rescored + again + (fwd if role.feature_pass else 0.0)))
    return out


def stage_flops(layers: list, parts: list) -> list:
    """(model, hardware) FLOPs per pipeline stage (``parts``: the plan's P + 1 layer indices)."""
    return [(sum(la.model for la in layers[a:b]), sum(la.hardware for la in layers[a:b]))
            for a, b in zip(parts[:-1], parts[1:])]


class StepCounter:
    """(model, hardware) FLOPs of a run's micro-batches, from their batch dicts (the host tensors'
    shapes, and a native-resolution tower's host image grids: no device read, no synchronisation),
    remembered per shape (the last ``REMEMBERED``: images of their own sizes make many)."""

    REMEMBERED = 4096

    def __init__(self, family, t: Training, negatives: int = 0):
        self.family, self.training, self.negatives = family, t, negatives
        self._seen: dict = {}

    def __call__(self, batch: dict) -> tuple:
        mb = self.family.micro_batch(batch)._replace(negatives=self.negatives)
        if mb not in self._seen:
            if len(self._seen) >= self.REMEMBERED:
                self._seen.pop(next(iter(self._seen)))  # the oldest
            layers = layer_flops(self.family, mb, self.training)
            self._seen[mb] = (sum(la.model for la in layers), sum(la.hardware for la in layers))
        return self._seen[mb]


def step_counter(run) -> Optional[StepCounter]:
    """The ``StepCounter`` of a resolved run (``train.setup.ResolvedRun``), or None for a family
    that does not describe its arithmetic (``Family.matmuls``)."""
    family, cfg = run.family, run.cfg
    topo = run.topo  # a feature pass runs with a pipeline, or several micro-batches per rank (parallel.strategies)
    feature_pass = family.step_loss and (topo.pipeline_stages > 1 or topo.accumulation_steps > 1)
    t = training(family, run.frozen, cfg.parallel.activation_checkpointing == "all", step_loss=feature_pass)
    counter = StepCounter(family, t, topo.batch_size if family.step_loss else 0)
    try:
        family.matmuls(family.layer_names()[0], MicroBatch(1, 1, 1))
    except NotImplementedError:
        return None
    return counter


# ---- device peaks ------------------------------------------------------------------------------
# Published dense (no sparsity) peak TFLOP/s per device: tensor cores for bf16 / fp16 / tf32, and
# plain fp32 (what fp32 matrix products run at unless TF32 is allowed)
PEAK_TFLOPS = {
    "H100 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
}


def device_kind(device_name: str) -> Optional[str]:
    """The ``PEAK_TFLOPS`` row of a device as its driver names it ("NVIDIA H100 80GB HBM3" -> H100
    SXM), or None (NVL boards, other GPUs, the CPU)."""
    name = device_name.upper()
    if "NVL" in name:
        return None
    if "H100" in name:
        return "H100 PCIe" if "PCIE" in name else "H100 SXM"
    return next((kind for kind in ("H200", "A100", "L40S") if kind in name), None)


def local_device() -> str:
    """This process's accelerator as its driver names it ("NVIDIA H100 80GB HBM3"), or the
    accelerator's kind ("cpu")."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    if acc.device_name() == "cuda":
        import torch
        return torch.cuda.get_device_name()
    return acc.device_name()


def matmul_precision(precision: str) -> str:
    """The ``PEAK_TFLOPS`` column of ``train.precision``: fp32 products run on TF32 tensor cores only
    where torch allows it (``torch.backends.cuda.matmul.allow_tf32``)."""
    if precision != "fp32":
        return precision
    import torch
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def peak_tflops(precision: str, override: Optional[float] = None, device: Optional[str] = None) -> Optional[float]:
    """Peak TFLOP/s of one device: ``override`` (``log.peak_tflops``) if set, else the table's for
    ``device`` (default: this process's) at ``train.precision``; None when the device is unknown."""
    if override is not None:
        return float(override)
    kind = device_kind(device if device is not None else local_device())
    return PEAK_TFLOPS[kind][matmul_precision(precision)] if kind else None


def utilization(model_flops: float, hardware_flops: float, seconds: float, devices: int,
                peak: Optional[float]) -> dict:
    """``tflops``: model TFLOP/s per device; ``mfu`` / ``hfu``: model / hardware FLOP/s per device as
    a fraction of ``peak`` (None without one)."""
    per_device = 1e-12 / (seconds * devices) if seconds > 0 else 0.0
    tflops, hw = model_flops * per_device, hardware_flops * per_device
    return {"tflops": tflops, "mfu": tflops / peak if peak else None, "hfu": hw / peak if peak else None}
