"""What the launcher says about the run: ``accelerate launch``'s DeepSpeed settings.

Accelerate starts the ranks and exports its YAML's ``deepspeed_config`` section and
``mixed_precision`` as ``ACCELERATE_*`` variables (``accelerate/utils/launch.py``,
``prepare_deepspeed_cmd_env``); mmpipe calls ``deepspeed.initialize`` itself, so it honours them
here, with the DeepSpeed JSON's contract (``mmpipe.config.deepspeed``):

- a setting the run config leaves unset is adopted into the run config (and logged once);
- a setting the run config gives explicitly (YAML or ``--set``) must agree, otherwise a one-line
  error names the Accelerate field and the run-config key;
- what Accelerate adopted then counts as set, so a DeepSpeed JSON disagreeing with it is an error
  naming the Accelerate field.

A variable counts as the user's when Accelerate exports it: Accelerate exports the DeepSpeed
fields only when the YAML or a ``--zero_stage``-style flag gives them. ``mixed_precision`` is
always exported (``no`` by default), so it counts when the YAML lists it
(``ACCELERATE_CONFIG_DS_FIELDS``) or when it is not ``no``.

| Accelerate (YAML field / variable)                    | mmpipe                                        |
|-------------------------------------------------------|-----------------------------------------------|
| deepspeed_config_file / ACCELERATE_DEEPSPEED_CONFIG_FILE | train.deepspeed_config                     |
| mixed_precision / ACCELERATE_MIXED_PRECISION (no/bf16/fp16) | train.precision (fp32/bf16/fp16); fp8 refused |
| zero_stage / ACCELERATE_DEEPSPEED_ZERO_STAGE          | parallel.zero_stage                           |
| gradient_clipping / ACCELERATE_GRADIENT_CLIPPING      | optim.max_grad_norm (0 = none, as in Accelerate) |
| gradient_accumulation_steps / ACCELERATE_GRADIENT_ACCUMULATION_STEPS | must equal the derived accumulation |
| offload_{optimizer,param}_device (+ _nvme_path)       | JSON zero_optimization.offload_* (ZeRO-2/3, P = 1; refused otherwise) |
| zero3_init_flag / ACCELERATE_DEEPSPEED_ZERO3_INIT     | true with ZeRO-3 refused (mmpipe builds the model without zero.Init) |
| zero3_save_16bit_model                                | JSON zero_optimization.stage3_gather_16bit_weights_on_model_save |
"""
from __future__ import annotations

import json
import os
from typing import Optional

from mmpipe.config.jsonpath import AUTO
from mmpipe.config.jsonpath import MISSING as _MISSING
from mmpipe.config.jsonpath import get as _get
from mmpipe.config.jsonpath import put as _put
from mmpipe.errors import ConfigError

PRECISION = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}

# (Accelerate YAML field, variable, run-config key, parse)
CONFIG_LINKS = [
    ("deepspeed_config_file", "ACCELERATE_DEEPSPEED_CONFIG_FILE", "train.deepspeed_config", str),
    ("mixed_precision", "ACCELERATE_MIXED_PRECISION", "train.precision", None),
    ("zero_stage", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "parallel.zero_stage", int),
    ("gradient_clipping", "ACCELERATE_GRADIENT_CLIPPING", "optim.max_grad_norm", float),
]
# (Accelerate YAML field, variable, DeepSpeed JSON key)
JSON_LINKS = [
    ("offload_optimizer_device", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "zero_optimization.offload_optimizer.device"),
    ("offload_optimizer_nvme_path", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
     "zero_optimization.offload_optimizer.nvme_path"),
    ("offload_param_device", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "zero_optimization.offload_param.device"),
    ("offload_param_nvme_path", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", "zero_optimization.offload_param.nvme_path"),
    ("zero3_save_16bit_model", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
     "zero_optimization.stage3_gather_16bit_weights_on_model_save"),
]
GAS = ("gradient_accumulation_steps", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
ZERO3_INIT = ("zero3_init_flag", "ACCELERATE_DEEPSPEED_ZERO3_INIT")

_logged: set = set()


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


class AccelerateSettings:
    """The ``accelerate launch`` settings in ``environ`` (empty when not launched by Accelerate)."""

    def __init__(self, environ=None):
        env = os.environ if environ is None else environ
        self.env = env
        listed = set(filter(None, env.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",")))
        self.deepspeed = env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
        self.values = {}  # YAML field -> (variable, raw value), only the ones the user gave
        mp = env.get("ACCELERATE_MIXED_PRECISION")
        if mp is not None and ("mixed_precision" in listed or mp.lower() != "no"):
            self.values["mixed_precision"] = ("ACCELERATE_MIXED_PRECISION", mp.lower())
        if self.deepspeed:
            for field, var, *_ in CONFIG_LINKS + JSON_LINKS + [GAS, ZERO3_INIT]:
                if field != "mixed_precision" and env.get(var) is not None:
                    self.values[field] = (var, env[var])
        self.origin = {}  # run-config key -> "Accelerate config FIELD=VALUE (VARIABLE)"
        self.adopted = []

    def __bool__(self):
        return bool(self.values)

    def name(self, field: str) -> str:
        var, raw = self.values[field]
        return f"Accelerate config {field}={raw} ({var})"

    # -- before the DeepSpeed JSON is read --------------------------------------------------
    def apply_to_config(self, cfg) -> dict:
        """Fill / check the run config; return {run-config key: description of the Accelerate source}."""
        explicit = set(cfg.explicit)
        for field, var, key, parse in CONFIG_LINKS:
            if field not in self.values:
                continue
            raw = self.values[field][1]
            if field == "mixed_precision":
                if raw not in PRECISION:
                    raise ConfigError(f"{self.name(field)}: mmpipe trains fp32, bf16 or fp16; set mixed_precision "
                                      "to no, bf16 or fp16")
                value = PRECISION[raw]
            else:
                if raw.lower() in ("auto", "none", ""):
                    continue
                try:
                    value = parse(raw)
                except ValueError:
                    raise ConfigError(f"{self.name(field)}: not a valid {parse.__name__}") from None
                if field == "gradient_clipping" and not value:
                    continue  # 0 = no clipping, as in Accelerate and the DeepSpeed JSON
            mine = cfg.get(key)
            same = (mine is not None and _same_path(value, mine)) if field == "deepspeed_config_file" else mine == value
            if not same:
                if key in cfg.explicit:
                    raise ConfigError(f"{self.name(field)} disagrees with run config {key}={json.dumps(mine)}; "
                                      f"set one of them (remove {field} from the Accelerate YAML, or {key} from the "
                                      "run config)")
                cfg.set(key, value)
                self.adopted.append(f"{key}={value}")
            explicit.add(key)  # now set: a DeepSpeed JSON must agree with it
            self.origin[key] = self.name(field)
        cfg.explicit = frozenset(explicit)
        return self.origin

    # -- after the DeepSpeed JSON is read, before it is filled ---------------------------------
    def apply_to_json(self, ds: dict, where: str, cfg) -> None:
        """Offload / ZeRO-3 settings go into the DeepSpeed JSON (or are refused)."""
        if "zero3_init_flag" in self.values and self.values["zero3_init_flag"][1].lower() in ("true", "1", "yes") \
                and cfg.parallel.zero_stage == 3:
            raise ConfigError(f"{self.name('zero3_init_flag')}: mmpipe builds the model itself, without "
                              "deepspeed.zero.Init; set zero3_init_flag: false")
        for field, var, ds_key in JSON_LINKS:
            if field not in self.values:
                continue
            raw = self.values[field][1]
            if field.endswith("_device"):
                if raw.lower() == "none":
                    continue
                if cfg.parallel.pipeline_stages > 1 or cfg.parallel.zero_stage < 2:
                    # with ZeRO 0/1 mmpipe computes the gradient norms itself (compute_grad_norm=false),
                    # which DeepSpeed's optimizer offload refuses; ZeRO-2/3 exclude a pipeline
                    raise ConfigError(f"{self.name(field)}: mmpipe supports ZeRO offload with zero_stage 2 or 3 and "
                                      f"pipeline_stages 1 only (here parallel.pipeline_stages="
                                      f"{cfg.parallel.pipeline_stages}, parallel.zero_stage={cfg.parallel.zero_stage}); "
                                      f"set {field}: none")
                value = raw.lower()
            elif field.endswith("_nvme_path"):
                dev = self.values.get(field.replace("_nvme_path", "_device"), (None, "none"))[1].lower()
                if raw.lower() == "none" or dev != "nvme":
                    continue
                value = raw
            else:
                value = raw.lower() in ("true", "1", "yes")
            have = _get(ds, ds_key)
            if have is not _MISSING and have != AUTO:
                if have != value:
                    raise ConfigError(f"{where}: {ds_key}={json.dumps(have)} disagrees with {self.name(field)}; "
                                      f"set one of them, or write \"auto\" in the JSON")
                continue
            _put(ds, ds_key, value)
            self.adopted.append(f"{ds_key}={json.dumps(value)}")
        for kind in ("optimizer", "param"):  # Accelerate reads but does not export the nvme paths
            if _get(ds, f"zero_optimization.offload_{kind}.device") == "nvme" and \
                    _get(ds, f"zero_optimization.offload_{kind}.nvme_path") in (_MISSING, AUTO, None):
                raise ConfigError(f"{where}: zero_optimization.offload_{kind}.device=nvme needs "
                                  f"zero_optimization.offload_{kind}.nvme_path (accelerate launch does not pass the "
                                  "YAML's nvme path to the ranks); set it in the DeepSpeed JSON")

    # -- once the accumulation is known ------------------------------------------------------
    def check_accumulation(self, cfg, topo) -> None:
        if GAS[0] not in self.values:
            return
        raw = self.values[GAS[0]][1]
        if not raw.isdigit():
            return  # "auto"
        if int(raw) != topo.accumulation_steps:
            raise ConfigError(
                f"{self.name(GAS[0])} but mmpipe derives the accumulation from train.batch_size={cfg.train.batch_size} "
                f"/ (parallel.micro_batch_size={cfg.parallel.micro_batch_size} x data_parallel={topo.data_parallel}) = "
                f"{topo.accumulation_steps}; remove gradient_accumulation_steps from the Accelerate YAML or change "
                "train.batch_size")

    def explain(self, err: ConfigError) -> ConfigError:
        """Append where a run-config value named in ``err`` came from (validation after adoption)."""
        msg = str(err)
        came = [f"{key} came from the {src}" for key, src in self.origin.items() if key in msg]
        return ConfigError(f"{msg} ({'; '.join(came)})") if came else err

    def log(self, rank: Optional[int] = None) -> None:
        if not self.adopted:
            return
        rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        line = "[mmpipe] from the Accelerate config: " + ", ".join(self.adopted)
        if rank == 0 and line not in _logged:
            print(line, flush=True)
        _logged.add(line)


