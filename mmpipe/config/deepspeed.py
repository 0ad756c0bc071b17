"""DeepSpeed JSON <-> run config: fill ``"auto"`` values, adopt concrete ones, refuse conflicts.

Contract (one place, tested):
- A key given in both the run config (explicitly, in YAML or ``--set``) and the DeepSpeed JSON
  must agree; otherwise a one-line error names both.
- A concrete JSON value the run config did not set explicitly is adopted into the run config,
  so the run config saved with the run is the truth.
- ``"auto"`` or a missing key is filled from the run config.
- Gradient clipping belongs to mmpipe: the JSON's ``gradient_clipping`` (if concrete) becomes
  ``optim.max_grad_norm`` and the resolved JSON says ``gradient_clipping: 0.0``, so DeepSpeed
  never clips a second time. mmpipe computes the true global and per-group norms across pipeline
  stages and data-parallel/ZeRO partitions and clips once (see ``mmpipe.config.groups``). Exception:
  ZeRO-2/3 (P = 1 only), where DeepSpeed clips globally and per-group limits are refused.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Optional

from mmpipe.config.jsonpath import AUTO
from mmpipe.config.jsonpath import MISSING as _MISSING
from mmpipe.config.jsonpath import get as _get
from mmpipe.config.launch_env import AccelerateSettings
from mmpipe.config.schema import RunConfig, validate
from mmpipe.errors import ConfigError
from mmpipe.parallel.topology import Topology

# (DeepSpeed dotted key, run-config dotted key)
LINKS = [
    ("train_batch_size", "train.batch_size"),
    ("train_micro_batch_size_per_gpu", "parallel.micro_batch_size"),
    ("zero_optimization.stage", "parallel.zero_stage"),
    ("optimizer.params.lr", "optim.lr"),
    ("optimizer.params.weight_decay", "optim.weight_decay"),
    ("optimizer.params.eps", "optim.eps"),
    ("optimizer.params.betas", "optim.betas"),
    ("optimizer.params.fused", "optim.fused"),
]

def load_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"train.deepspeed_config: file not found: {path} (point it at a JSON in ds_configs/ or unset it)")
    try:
        with open(path) as fh:
            return json.load(fh)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} line {e.lineno}: not valid JSON ({e.msg})") from None


def _conflict(path, ds_key, ds_val, key, val, origin=None):
    theirs = (origin or {}).get(key)  # a value adopted from `accelerate launch` names its Accelerate field
    mine = f"{theirs} (-> {key}={json.dumps(val)})" if theirs else f"run config {key}={json.dumps(val)}"
    raise ConfigError(f"{path}: {ds_key}={json.dumps(ds_val)} disagrees with {mine}; "
                      f"set one of them, or write \"auto\" in the JSON")


def resolve(cfg: RunConfig, world_size: int) -> tuple[dict, Topology]:
    """Return (resolved DeepSpeed dict, topology). May adopt JSON values and `accelerate launch`
    settings (``mmpipe.config.launch_env``) into ``cfg``."""
    acc = AccelerateSettings()
    origin = acc.apply_to_config(cfg) if acc else {}  # first: it may name the DeepSpeed JSON
    path = cfg.train.deepspeed_config
    ds = copy.deepcopy(load_json(path)) if path else {}
    where = path or "generated DeepSpeed config"

    _adopt(ds, cfg, where, origin)
    if acc:  # offload / ZeRO-3 settings: into the JSON, once the ZeRO stage is known
        acc.apply_to_json(ds, where, cfg)

    try:
        validate(cfg)  # adopted values must be valid too (e.g. ZeRO-3 with a pipeline)
        topo = Topology.from_config(cfg, world_size)
        acc.check_accumulation(cfg, topo)
    except ConfigError as e:
        raise acc.explain(e) from None

    gas = _get(ds, "gradient_accumulation_steps")
    if gas is not _MISSING and gas != AUTO and gas != topo.accumulation_steps:
        raise ConfigError(
            f"{where}: gradient_accumulation_steps={gas} but train.batch_size={cfg.train.batch_size} / "
            f"(micro_batch_size={cfg.parallel.micro_batch_size} x data_parallel={topo.data_parallel}) = "
            f"{topo.accumulation_steps}; write \"auto\"")

    _fill(ds, cfg, topo)
    for block in MONITORS:  # DeepSpeed's monitors write into the run directory unless told otherwise
        if isinstance(ds.get(block), dict) and ds[block].get("enabled") and not ds[block].get("output_path") \
                and block != "wandb":
            ds[block]["output_path"] = os.path.join(cfg.train.output_dir, "ds_monitor", "")
    leftovers = [k for k, v in _walk(ds) if v == AUTO]
    if leftovers:
        raise ConfigError(f"{where}: mmpipe cannot fill \"auto\" for {', '.join(leftovers)}; give a value")
    acc.log()
    return ds, topo


MONITORS = ("tensorboard", "csv_monitor", "wandb", "comet")


def _adopt(ds: dict, cfg: RunConfig, where: str, origin: dict) -> None:
    """Concrete JSON values into the run config (a key the run config set explicitly must agree)."""
    for ds_key, key in LINKS:
        v = _get(ds, ds_key)
        if v is _MISSING or v == AUTO:
            continue
        mine = cfg.get(key)
        if isinstance(mine, (list, tuple)):
            mine = list(mine)
        if v != mine:
            if key in cfg.explicit:
                _conflict(where, ds_key, v, key, mine, origin)
            cfg.set(key, v)

    # precision: bf16.enabled / fp16.enabled
    for prec in ("bf16", "fp16"):
        v = _get(ds, f"{prec}.enabled")
        if v is _MISSING or v == AUTO:
            continue
        if v and cfg.train.precision != prec:
            if "train.precision" in cfg.explicit:
                _conflict(where, f"{prec}.enabled", v, "train.precision", cfg.train.precision, origin)
            cfg.train.precision = prec
        if not v and cfg.train.precision == prec and "train.precision" in cfg.explicit:
            _conflict(where, f"{prec}.enabled", v, "train.precision", cfg.train.precision, origin)

    clip = _get(ds, "gradient_clipping")
    if clip is not _MISSING and clip != AUTO and clip:
        if "optim.max_grad_norm" in cfg.explicit and cfg.optim.max_grad_norm != clip:
            _conflict(where, "gradient_clipping", clip, "optim.max_grad_norm", cfg.optim.max_grad_norm, origin)
        cfg.optim.max_grad_norm = float(clip)


def _fill(ds: dict, cfg: RunConfig, topo: Topology) -> None:
    """The JSON's batch, clipping, ZeRO, precision and optimizer entries from the resolved run config."""
    ds["train_batch_size"] = cfg.train.batch_size
    ds["train_micro_batch_size_per_gpu"] = cfg.parallel.micro_batch_size
    ds["gradient_accumulation_steps"] = topo.accumulation_steps
    # mmpipe clips (ZeRO 0/1, every layout); under ZeRO-2/3 (P = 1 only) DeepSpeed clips globally
    ds["gradient_clipping"] = 0.0 if cfg.parallel.zero_stage < 2 else float(cfg.optim.max_grad_norm or 0.0)
    zero = ds.setdefault("zero_optimization", {})
    zero["stage"] = cfg.parallel.zero_stage
    if cfg.parallel.zero_stage == 1 and cfg.train.precision != "bf16":
        # DeepSpeed's ZeRO optimizer all-reduces one norm *per param group* over the pipeline group;
        # with per-branch groups the stages hold different groups, so those collectives would not
        # pair up (a hang). mmpipe computes and applies the norms itself; DeepSpeed's are unused.
        # Only ZeRO-1 (DeepSpeed allows compute_grad_norm=false with ZeRO 1/2 only): under ZeRO-2/3
        # (P = 1) DeepSpeed's own global norm drives its clip and mmpipe's grad_norm metric.
        zero["compute_grad_norm"] = False
    for prec in ("bf16", "fp16"):
        sec = ds.setdefault(prec, {})
        sec["enabled"] = cfg.train.precision == prec
        if not sec["enabled"] and len(sec) == 1:
            del ds[prec]
    if cfg.train.precision == "bf16" and cfg.parallel.zero_stage == 1 and cfg.parallel.pipeline_stages > 1:
        # DeepSpeed's pipeline needs fp32 gradient accumulation for bf16 + ZeRO-1 (BF16_Optimizer)
        ds.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
    opt = ds.setdefault("optimizer", {"type": "AdamW", "params": {"torch_adam": True}})
    params = opt.setdefault("params", {})
    for ds_key, key in LINKS:
        if ds_key.startswith("optimizer.params."):
            name = ds_key.rsplit(".", 1)[1]
            if params.get(name, AUTO) == AUTO:
                params[name] = cfg.get(key)
    choice = params.pop("fused", None)  # the config's (a JSON's adopted): None = unset
    if params.get("torch_adam"):  # DeepSpeed passes the params on to torch.optim.AdamW
        use = fused_adamw(cfg)
        if use and params.get("foreach"):  # torch takes one of the two
            if choice:
                raise ConfigError(f"optim.fused=true and {cfg.train.deepspeed_config}'s optimizer.params.foreach=true: "
                                  "torch's AdamW runs one kernel or the other; drop one of them")
            use = False
        if use:
            params["fused"] = True
    ds.setdefault("steps_per_print", 10 ** 9)  # mmpipe logs itself
    ds.setdefault("wall_clock_breakdown", False)


def adamw_kernel(cfg: RunConfig, gpu: Optional[bool] = None) -> str:
    """Which of torch's AdamW kernels the run's step takes: ``fused`` (``optim.fused``; unset: on CUDA
    and XPU, where torch has it and the step is memory-bound), else torch's default there:
    ``foreach`` (multi-tensor) on CUDA and XPU, ``single`` (a loop over the parameters) on the CPU.
    ``gpu``: for a GPU run planned elsewhere (default: this process's accelerator). The memory model
    reads it too: the multi-tensor step makes an fp32 temporary per parameter, the others none."""
    if gpu is None:
        from deepspeed.accelerator import get_accelerator
        gpu = get_accelerator().device_name() in ("cuda", "xpu")
    if cfg.optim.fused or (cfg.optim.fused is None and gpu):
        return "fused"
    return "foreach" if gpu else "single"


def fused_adamw(cfg: RunConfig) -> bool:
    """Whether this process's AdamW step is torch's fused kernel (``adamw_kernel``)."""
    return adamw_kernel(cfg) == "fused"


def _walk(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _walk(v, prefix + k + ".")
        else:
            yield prefix + k, v
