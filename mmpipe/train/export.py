"""``mmpipe export --run DIR [--step N] --out DIR [--dtype fp32|bf16] [--format auto|hf|mmpipe]``: a
run's checkpoint (any layout, no DeepSpeed engine) as a directory others load.

transformers format (``hf``): safetensors weights, config, the run's tokenizer and an image processor
whose preprocessing is the run's (square resize + centre crop to the tower's size, its mean/std):

- CLIP ViT + CLIP text -> ``CLIPModel`` + ``CLIPProcessor``
- CLIP ViT + BERT pooled by its pooler -> ``VisionTextDualEncoderModel`` + its processor
- VLM -> ``LlavaForConditionalGeneration`` + ``LlavaProcessor`` (the run's chat template)

mmpipe's own format (``mmpipe``; what ``auto`` picks when no transformers class computes the same
outputs, e.g. a ResNet image tower): ``model.safetensors`` in the plain model's names, ``config.yaml``
(the run's ``model`` section), the config files of its pretrained directories (no weights), the
tokenizer and the image processor; ``mmpipe.build_model(DIR)`` returns the trained model.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch

from mmpipe._version import __version__
from mmpipe.config.fields import thawed_copy
from mmpipe.config.resolve import build_family
from mmpipe.config.schema import family_of, load_config
from mmpipe.data.tokenizer import load_tokenizer, tokenizer_choice
from mmpipe.errors import ConfigError, NoHFFormat
from mmpipe.families.lora import adapter_state as lora_adapters
from mmpipe.families.lora import base_name, merged, peft_targets
from mmpipe.parallel.plain import plain_model
from mmpipe.train.checkpoint_weights import load_weights

MARKER = "mmpipe_export.json"
_PRETRAINED_FILES = ("config.json", "preprocessor_config.json")


def run_tokenizer(cfg, family_cls, run_dir: str):
    """The tokenizer a run trained with: ``data.tokenizer``, the pretrained weights' own, or the one
    mmpipe trained into the run directory; with the family's special tokens."""
    path, what = tokenizer_choice(cfg.data, *family_cls.tokenizer_weights(cfg.model), run_dir)
    tok = load_tokenizer(path, what)
    return family_cls.prepare_tokenizer(tok)


def export(run_dir: str, out: str, step: Optional[int] = None, dtype: str = "fp32", fmt: str = "auto",
           merge: bool = False) -> tuple:
    """Write the export; returns (out, what was written: a transformers class or "mmpipe", why).
    A LoRA run (``optim.train_type: lora``) writes a peft adapter directory whose base model is
    ``OUT/base`` (the base weights as trained on, with the run's generation config);
    ``merge``: the adapters folded into full weights instead, written as any run's."""
    cfg_path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"--run {run_dir}: no config.yaml (not an mmpipe run directory)")
    if dtype not in ("fp32", "bf16"):
        raise ConfigError(f"--dtype {dtype}: give fp32 or bf16")
    if fmt not in ("auto", "hf", "mmpipe"):
        raise ConfigError(f"--format {fmt}: give auto, hf or mmpipe")
    cfg = load_config(cfg_path)
    state = load_weights(run_dir, step)  # one line when there is no checkpoint
    family = build_family(cfg.model, cfg.train.seed)
    spec = build_family(cfg, cfg.train.seed).lora if cfg.optim.train_type == "lora" else None
    if merge and spec is None:
        raise ConfigError(f"--merge: {run_dir} trained full weights (optim.train_type=full); there are no adapters "
                          "to merge: leave --merge out")
    if spec is not None and not merge and fmt == "mmpipe":
        raise ConfigError("--format mmpipe of a LoRA run: add --merge (mmpipe's format holds full weights), or "
                          "leave --format out for a peft adapter directory")
    adapters = lora_adapters(state) if spec is not None and not merge else None
    # full weights: the adapters folded in (--merge), or for an adapter directory its base model alone
    state = merged(state, spec) if adapters is None else {base_name(k): v for k, v in state.items()
                                                          if k not in adapters}
    tok = run_tokenizer(cfg, family_of(cfg), run_dir)
    final = out.rstrip(os.sep) or out
    if os.path.lexists(final) and not (os.path.isdir(final) and not os.path.islink(final)
                                       and (not os.listdir(final) or _written_by_export(final))):
        raise ConfigError(f"--out {out}: exists and is not an earlier mmpipe export (no {MARKER} / {HF_MARKER}); give "
                          "a new directory (nothing was written)")
    part, old = f"{final}.partial-{os.getpid()}", f"{final}.old-{os.getpid()}"
    shutil.rmtree(part, ignore_errors=True)
    os.makedirs(part)
    try:
        if adapters is not None:
            what, why = _write_adapter(cfg, family, spec, state, adapters, tok, part, dtype, final)
        else:
            what, why = _write(cfg, family, state, tok, part, fmt, dtype)
        if os.path.isdir(final):  # an earlier export: swapped out whole, removed once the new one is in place
            os.replace(final, old)
        os.replace(part, final)
    except BaseException:
        if os.path.isdir(old) and not os.path.exists(final):
            os.replace(old, final)  # the earlier export back as it was
        shutil.rmtree(part, ignore_errors=True)  # nothing half-written is left behind
        raise
    shutil.rmtree(old, ignore_errors=True)
    return final, what, why


HF_MARKER = "mmpipe_hf_export.json"  # what an mmpipe export in transformers' format writes beside it
BASE_DIR = "base"  # a LoRA adapter directory's base model, inside it (adapter_config.json names it relatively)


def _written_by_export(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER)) or os.path.isfile(os.path.join(path, HF_MARKER))


def _write(cfg, family, state: dict, tok, out: str, fmt: str, dtype: str) -> tuple:
    if fmt != "mmpipe":
        try:
            model, processor = family.hf_export(state, tok, cfg.data)
        except NoHFFormat as e:
            if fmt == "hf":
                raise ConfigError(f"--format hf: {e}; export with --format mmpipe") from None
            why = str(e)
        else:
            if dtype == "bf16":
                model = model.to(torch.bfloat16)
            model.save_pretrained(out, safe_serialization=True)
            processor.save_pretrained(out)
            with open(os.path.join(out, HF_MARKER), "w") as fh:  # so a later export may replace this directory
                json.dump({"format": "transformers", "class": type(model).__name__, "mmpipe_version": __version__}, fh)
            return type(model).__name__, "transformers"
    else:
        why = "--format mmpipe"
    if dtype == "bf16":
        state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
    _save_own(cfg, family, state, tok, out)
    return "mmpipe", why


def _write_adapter(cfg, family, spec, base: dict, adapters: dict, tok, out: str, dtype: str, final: str) -> tuple:
    """A peft adapter directory (``adapter_config.json``, ``adapter_model.safetensors``, the
    tokenizer and processor) written by peft itself, for ``PeftModel.from_pretrained(base, OUT)``;
    the base model in ``OUT/base``."""
    from peft import LoraConfig, get_peft_model
    try:
        model, processor = family.hf_export(base, tok, cfg.data)
    except NoHFFormat as e:
        raise ConfigError(f"a LoRA run of model.type={cfg.model.type} has no transformers base class ({e}); "
                          "export with --merge --format mmpipe") from None
    if family.hf.adapter_name is None:
        raise ConfigError(f"a LoRA run of model.type={cfg.model.type}: mmpipe writes peft adapter directories for the "
                          "VLM only; export with --merge (full weights)")
    # the base as the run trained on it (its generation config stops at the end of a turn), written beside
    base_dir = os.path.join(final, BASE_DIR)
    (model.to(torch.bfloat16) if dtype == "bf16" else model).save_pretrained(os.path.join(out, BASE_DIR))
    processor.save_pretrained(os.path.join(out, BASE_DIR))
    with open(os.path.join(out, BASE_DIR, HF_MARKER), "w") as fh:
        json.dump({"format": "transformers", "class": type(model).__name__, "mmpipe_version": __version__}, fh)
    hf_names = {k: family.hf.adapter_name(k) for k in adapters}
    peft_model = get_peft_model(model, LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                                                  bias="none", **peft_targets(spec, hf_names.values())))
    params = dict(peft_model.base_model.model.named_parameters())
    with torch.no_grad():
        for k, v in adapters.items():
            params[hf_names[k]].copy_(v)
    # (saved with the written base's path, which peft reads for its vocabulary check, then named as below)
    peft_model.peft_config["default"].base_model_name_or_path = os.path.abspath(os.path.join(out, BASE_DIR))
    if dtype == "bf16":
        peft_model = peft_model.to(torch.bfloat16)
    peft_model.save_pretrained(out)
    with open(os.path.join(out, "adapter_config.json")) as fh:
        adapter_cfg = json.load(fh)
    # the base as peft users name it: the hub id (and its commit) the run started from, else the absolute path
    # of the base copy written here (AutoPeftModel.from_pretrained(OUT) from any directory; after a move,
    # PeftModel.from_pretrained(<OUT>/base, OUT))
    pin = getattr(cfg, "hub", {}).get("model.pretrained")
    if pin:
        adapter_cfg["base_model_name_or_path"], adapter_cfg["revision"] = pin.split("@", 1)
    else:
        adapter_cfg["base_model_name_or_path"] = os.path.abspath(base_dir)
    with open(os.path.join(out, "adapter_config.json"), "w") as fh:
        json.dump(adapter_cfg, fh, indent=2, sort_keys=True)
    processor.save_pretrained(out)
    with open(os.path.join(out, HF_MARKER), "w") as fh:
        json.dump({"format": "peft", "class": "PeftModel", "base": BASE_DIR, "mmpipe_version": __version__}, fh)
    return "PeftModel", f"LoRA adapters on {type(model).__name__} from {base_dir}"


def _save_own(cfg, family, state: dict, tok, out: str) -> None:
    """mmpipe's own format: plain weights, the model section (pretrained directories replaced by
    copies of their config files), tokenizer, image processor."""
    import yaml
    from safetensors.torch import save_file

    model_section = cfg.to_dict()["model"]

    def localise(section: dict, where: str) -> None:
        for k, v in section.items():
            if isinstance(v, dict):
                localise(v, f"{where}.{k}")
            elif k == "pretrained" and v:
                rel = os.path.join("pretrained", where.replace(".", "_"))
                os.makedirs(os.path.join(out, rel), exist_ok=True)
                for f in _PRETRAINED_FILES:
                    if os.path.isfile(os.path.join(v, f)):
                        shutil.copy(os.path.join(v, f), os.path.join(out, rel, f))
                section[k] = rel
    localise(model_section, "model")
    with open(os.path.join(out, "config.yaml"), "w") as fh:
        fh.write("# mmpipe export: mmpipe.build_model(<this directory>) returns the trained model\n")
        yaml.safe_dump({"model": model_section, "data": {"max_length": cfg.data.max_length}}, fh, sort_keys=False)
    seen, flat = set(), {}
    for k, v in state.items():  # a tied weight (a VLM's head and embedding) is saved once per name:
        key = v.untyped_storage().data_ptr()  # safetensors refuses tensors that share a storage
        flat[k] = v.clone().contiguous() if key in seen else v.contiguous()
        seen.add(key)
    save_file(flat, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(out)
    proc = family.preprocessor()
    if proc is not None:
        proc.save_pretrained(out)
    with open(os.path.join(out, MARKER), "w") as fh:
        json.dump({"format": "mmpipe", "model_type": family.name, "mmpipe_version": __version__}, fh)


def is_export(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, MARKER))


def load_export_weights(path: str) -> dict:
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


def build_exported(path: str, seed=None):
    """The plain model of an mmpipe-format export with its weights (pretrained paths resolved in it)."""
    cfg = load_config(os.path.join(path, "config.yaml"), hub=False)  # (its pretrained paths: relative to it)

    def resolve(section) -> None:
        for name in getattr(section, "__dataclass_fields__", {}):
            v = getattr(section, name)
            if hasattr(v, "__dataclass_fields__"):
                resolve(v)
            elif name == "pretrained" and v and not os.path.isabs(v):
                object.__setattr__(section, name, os.path.join(path, v))
    model_cfg = thawed_copy(cfg.model)
    resolve(model_cfg)
    family = build_family(model_cfg, 0 if seed is None else seed)
    family.skip_pretrained = True
    model = plain_model(family)
    model.load_state_dict(load_export_weights(path), strict=True)
    return model
