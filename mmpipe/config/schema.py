"""Typed run configuration: YAML in, ``--set section.key=value`` overrides, validated once.

Every field carries a one-line ``help`` (printed by ``mmpipe config --reference`` and kept in
docs/configuration.md). Sub-components receive only the sub-config they use (``cfg.model``, ``cfg.data``...).
The fully resolved config is written into the run directory by the trainer.
"""
from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Union

import yaml

from mmpipe.config.fields import Section, in_range, range_text, thawed_copy
from mmpipe.config.fields import option as _f
from mmpipe.config.registry import get_family
from mmpipe.errors import ConfigError
from mmpipe.parallel.schedules import SCHEDULES


def _model_section(type_name: str = "clip", where: str = "config"):
    """The ``model:`` dataclass of the family ``model.type`` names (through the registry)."""
    return get_family(type_name, where).config_class


def family_of(cfg):
    """The family class of a run config."""
    return get_family(cfg.model.type, cfg.source or "config")


@dataclass
class DataConfig(Section):
    train: Optional[str] = _f(None, "training manifest: .jsonl ({image, text} per line) or .csv (header image,text); "
                              "model.type=vlm: chat data, LLaVA .json or ms-swift .jsonl")
    val: Optional[str] = _f(None, "held-out data in the same format (retrieval eval; VLM: loss and token accuracy)")
    image_folder: Optional[str] = _f(None, "LLaVA JSON: directory its image paths are relative to; unset = the "
                                     "JSON's own directory")
    tokenizer: Optional[str] = _f(None, "hub id (org/name[@revision]) or local transformers tokenizer dir; unset = train WordPiece on the captions")
    tokenizer_vocab_size: int = _f(2000, "vocabulary size when mmpipe trains the tokenizer", ge=1)
    max_length: int = _f(32, "tokens per caption (padded/truncated)", ge=1)
    num_workers: int = _f(2, "DataLoader worker processes per data-reading rank", ge=0)
    pin_memory: bool = _f(True, "pin host memory (used only when the device is not the CPU)")
    prefetch_factor: int = _f(2, "batches prefetched per worker", ge=1)
    persistent_workers: bool = _f(True, "keep workers alive across epochs")
    max_bad_fraction: float = _f(0.05, "stop with an error when more than this fraction of samples is unusable", ge=0, le=1)
    cache: Optional[str] = _f(None, "preprocessed cache dir from `mmpipe data prepare` (uint8 images + token ids); "
                              "replaces decoding data.train")
    decode_size: Optional[int] = _f(None, "square size images are decoded (or cached) at before augmentation; unset = "
                                    "the model's image size", ge=1)
    min_pixels: Optional[int] = _f(None, "native-resolution families (qwen2_5_vl): the fewest pixels an image is resized to "
                                   "(ms-swift's MIN_PIXELS); unset = the model directory's processor", ge=1)
    max_pixels: Optional[int] = _f(None, "native-resolution families: the most pixels an image is resized to (ms-swift's "
                                   "MAX_PIXELS; sets the largest image-token count); unset = the directory's processor", ge=1)
    video_fps: Optional[float] = _f(None, "video (qwen2_5_vl, qwen3_vl, qwen3_5): frames sampled per second of a video "
                                    "file, and the rate a directory of frames was taken at (ms-swift's FPS); unset = "
                                    "the model directory's video processor (2)", gt=0)
    video_min_frames: Optional[int] = _f(None, "video: the fewest frames sampled (ms-swift's FPS_MIN_FRAMES); unset = "
                                         "the video processor's (4)", ge=1)
    video_max_frames: Optional[int] = _f(None, "video: the most frames sampled (ms-swift's FPS_MAX_FRAMES: the frame "
                                         "budget); unset = the video processor's (768)", ge=1)
    video_min_pixels: Optional[int] = _f(None, "video: the video processor's lower pixel bound (its size.shortest_edge)",
                                         ge=1)
    video_max_pixels: Optional[int] = _f(None, "video: the video processor's pixel budget (its size.longest_edge: per "
                                         "frame for qwen2_5_vl, the whole clip for qwen3_vl / qwen3_5; ms-swift's "
                                         "VIDEO_MAX_PIXELS)", ge=1)
    augment: str = _f("none", "none, crop (RandomResizedCrop) or crop_flip (+ RandomHorizontalFlip); applied after "
                      "decode or cache, seeded by (seed, epoch, sample)")
    crop_scale: list = _f([0.9, 1.0], "RandomResizedCrop scale range (open_clip's default)")
    padding: str = _f("batch", "batch: pad captions to the micro-batch's longest (rounded up to data.pad_multiple); "
                      "max_length: always pad to data.max_length")
    pad_multiple: int = _f(4, "with padding=batch, round the padded length up to this multiple (fewer distinct shapes)", ge=1)
    packing: bool = _f(False, "model.type=vlm: pack several chat samples into each sequence of up to data.max_length "
                       "(never splitting one; attention stays within a sample, positions restart per sample); a "
                       "micro-batch then holds packs, and train.batch_size counts packs (ms-swift --packing)")
    group_by_length: bool = _f(False, "sort captions by token length within windows of data.group_window micro-batches "
                               "(less padding; batches then share caption lengths, which changes the negatives)")
    balance: str = _f("none", "none: each step's micro-batches as the sampler cuts them; cost: each step's samples "
                      "regrouped among its micro-batches and data-parallel ranks so every slot costs about the same "
                      "on every stage (priced from the measured layer profile; the same samples per step, each with its "
                      "own dropout masks, so the same loss: in fp32 to rtol 1e-5, in bf16 to its precision; see "
                      "docs/balancing.md)")
    balance_evenness: float = _f(0.25, "data.balance=cost in a pipeline: the weight of the slot spread (max / mean slot "
                                 "time - 1) against the predicted step in the regrouping's objective; higher trades "
                                 "predicted speed for evener slots (see docs/balancing.md)", ge=0.0)
    balance_refit: int = _f(20, "data.balance=cost in a pipeline: every this many steps, refit each stage's prices "
                            "(per image token, per token slot, per micro-batch) to the micro-batch times the stage "
                            "clock measured over twice as many steps; 0: the profile's prices throughout", ge=0)
    group_window: int = _f(64, "micro-batches per length-grouping window (or, for shards, samples per window / micro-batch)", ge=1)
    shuffle_buffer: int = _f(1000, "shards: samples in the streaming shuffle buffer of each loader worker", ge=1)
    log_samples: bool = _f(False, "write the sample keys each data-reading rank trains on to OUTPUT/samples/rank*.jsonl (one JSON object per micro-batch: rank, step, stage, keys, and the padded token length where the family has an attention mask)")


@dataclass
class ParallelConfig(Section):
    layout: str = _f("manual", "manual (the P, placement and ZeRO stage set here) or auto: the run predicts every "
                     "layout of its ranks (data parallel with ZeRO 0-3, each pipeline P dividing the world size, "
                     "P x DP; see mmpipe plan --world) and takes the fastest that fits memory, logged and saved "
                     "in layout.json")
    pipeline_stages: int = _f(1, "P: pipeline stages; the data-parallel degree is world_size / P; auto = layout auto", ge=1)
    replan: str = _f("off", "auto: move the stage boundaries once during the run when the measured step is slower "
                      "than the best cut of the measured stage costs predicts (by parallel.replan_margin, for "
                      "parallel.replan_window steps in a row): checkpoint, continue on the new cut in the same "
                      "processes (the same losses); off: never (see docs/balancing.md)")
    replan_window: int = _f(3, "parallel.replan=auto: steps whose median is compared, and how many in a row must agree",
                            ge=1)
    replan_margin: float = _f(0.15, "parallel.replan=auto: how much slower than the best cut's prediction a step must be",
                              ge=0)
    placement: str = _f("modality", "modality (stages never mix branches, split between branches by measured cost; a "
                        "one-layer segment rides with the stage before it), "
                        "balanced (boundaries anywhere), auto (whichever the simulator predicts faster), or "
                        "DeepSpeed's uniform, parameters, type:REGEX")
    schedule: str = _f("auto", "the pipeline order (mmpipe.parallel.schedules): 1f1b (DeepSpeed's default order); "
                       "frozen_first (leading stages whose layers are all frozen run their forwards back to back and "
                       "never wait for or receive a gradient; 1F1B after them); zb_h1 (zero bubble's ZB-H1: each "
                       "backward split into the input gradient and the linear layers' weight gradients, which fill "
                       "the bubble; 1F1B's live activations plus the queued weight-gradient inputs); gpipe (every "
                       "forward, then every backward); auto: with measured costs, every cut is predicted under every "
                       "order that applies to it and the fastest pair within parallel.memory_budget_gb is taken "
                       "(orders of that cut predicted within 5% of it are a tie: the one holding least memory); "
                       "without them frozen_first where leading stages train nothing, else 1f1b")
    profile: bool = _f(True, "cost layers by measured forward/backward time (rank 0 profiles at start, cached in "
                       "~/.cache/mmpipe or $MMPIPE_CACHE); false: by trainable parameter count")
    plan: Optional[str] = _f(None, "JSON file with \"stages\": per-stage lists of layer names (e.g. a run's plan.json); overrides placement")
    micro_batch_size: Union[int, str] = _f(8, "samples per micro-batch per data-parallel rank, or auto: the largest "
                                            "divisor of the per-rank batch whose probed peak memory fits memory_budget_gb")
    memory_budget_gb: Optional[float] = _f(None, "per-device memory budget for micro_batch_size=auto; unset = the "
                                           "device's total memory", gt=0)
    zero_stage: int = _f(0, "ZeRO stage (0 or 1 with a pipeline; up to 3 with P = 1)", ge=0, le=3)
    expert_parallel: int = _f(1, "E: a MoE model's routed experts split over E consecutive data-parallel ranks of "
                              "each stage (E divides the data-parallel degree and the expert count; tokens exchanged "
                              "by all-to-all; expert weights, gradients and optimizer state / E; ZeRO 0-2)", ge=1)
    activation_checkpointing: str = _f("auto", "none; all: every trained layer keeps only its input and "
                                       "recomputes its forward in backward (less activation memory, about one more "
                                       "forward; dropout replayed); forward-only frozen layers are never recomputed "
                                       "(open_clip --grad-checkpointing, ms-swift gradient_checkpointing); auto: with "
                                       "layout: auto the layout chooser decides per layout, by predicted memory and "
                                       "step time; with a manual layout, none")


@dataclass
class GroupConfig(Section):
    """A named parameter group: its own lr, weight decay, gradient-norm limit, or frozen."""
    patterns: list = _f([], "regexes matched (re.search) against the plain model's parameter names")
    lr: Optional[float] = _f(None, "learning rate; unset = optim.lr", ge=0)
    weight_decay: Optional[float] = _f(None, "weight decay (matrices only); unset = optim.weight_decay", ge=0)
    max_grad_norm: Optional[float] = _f(None, "clip this group's gradient norm (over all stages/ranks) to this; unset = no clip", gt=0)
    freeze: bool = _f(False, "no gradients, no optimizer state, excluded from norms")


def default_groups(type_name: str = "clip") -> dict:
    """The family's default parameter groups (one per segment, plus its special parameters)."""
    return {name: GroupConfig(patterns=list(p)) for name, p in get_family(type_name).default_groups.items()}


@dataclass
class OptimConfig(Section):
    lr: float = _f(5e-4, "peak learning rate (AdamW)", ge=0)
    weight_decay: float = _f(0.1, "decoupled weight decay; not applied to biases, norms, embeddings, logit_scale", ge=0)
    betas: list = _f([0.9, 0.98], "AdamW betas")
    eps: float = _f(1e-6, "AdamW epsilon", gt=0)
    fused: Optional[bool] = _f(None, "torch's fused AdamW kernel (the whole step in one pass, no temporaries; "
                               "transformers' Trainer default adamw_torch_fused); unset = on CUDA and XPU, not on the "
                               "CPU, whose runs keep torch's default step")
    warmup_steps: int = _f(0, "linear warm-up steps", ge=0)
    schedule: str = _f("cosine", "cosine or constant after warm-up")
    min_lr_ratio: float = _f(0.0, "final lr as a fraction of the peak (cosine)", ge=0, le=1)
    max_grad_norm: Optional[float] = _f(None, "global gradient-norm clip, applied by mmpipe across all stages/ranks after the group clips (by DeepSpeed under ZeRO-2/3); unset = no clip", gt=0)
    groups: Dict[str, GroupConfig] = field(default_factory=default_groups, metadata={
        "help": "named parameter groups (defaults vision, projector, text, logit_scale); each key: patterns, lr, "
                "weight_decay, max_grad_norm, freeze"})
    freeze: list = _f([], "groups to freeze, by name (e.g. [vision]); the spellings below (open_clip's, ms-swift's) "
                          "freeze the group they name")
    freeze_vision: bool = _f(False, "shortcut: freeze the vision group (open_clip --lock-image, ms-swift freeze_vit)")
    freeze_projector: bool = _f(False, "shortcut: freeze the projector group (ms-swift freeze_aligner)")
    freeze_text: bool = _f(False, "shortcut: freeze the text group (open_clip --lock-text, ms-swift freeze_llm)")
    freeze_vit: Optional[bool] = _f(None, "ms-swift's name (VLM): freeze the vision group; unset = false for full "
                                    "training, true with train_type=lora (ms-swift's default: no adapters in the ViT)")
    freeze_aligner: Optional[bool] = _f(None, "ms-swift's name (VLM): freeze the projector group; unset = false for "
                                        "full training, true with train_type=lora")
    freeze_llm: bool = _f(False, "ms-swift's name (VLM): freeze the llm group")
    vit_lr: Optional[float] = _f(None, "ms-swift's name (VLM): the vision group's lr (optim.groups.vision.lr)", ge=0)
    aligner_lr: Optional[float] = _f(None, "ms-swift's name (VLM): the projector group's lr (optim.groups.projector.lr)", ge=0)
    train_type: str = _f("full", "full (every weight of the groups not frozen) or lora (peft LoRA adapters on the "
                         "target modules of the groups not frozen; every base weight frozen); ms-swift's --train_type")
    lora_rank: int = _f(8, "LoRA rank r (ms-swift --lora_rank)", ge=1)
    lora_alpha: int = _f(32, "LoRA alpha: the update is scaled by alpha / r (ms-swift --lora_alpha)", ge=1)
    lora_dropout: float = _f(0.05, "dropout on the LoRA branch's input (ms-swift --lora_dropout)", ge=0, lt=1)
    target_modules: list = _f(["all-linear"], "module names (suffixes) that get adapters; all-linear = every "
                              "nn.Linear of a trained layer except the output head (ms-swift --target_modules)")
    target_parameters: list = _f([], "parameter names (suffixes) that get peft's parameter LoRA: a MoE's fused routed "
                                 "experts, e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj] (peft's and "
                                 "ms-swift's --target_parameters; a low-rank update per expert; lora_dropout 0)")


FREEZE_FLAGS = ("freeze_vision", "freeze_projector", "freeze_text", "freeze_vit", "freeze_aligner", "freeze_llm")
LR_FLAGS = ("vit_lr", "aligner_lr")


@dataclass
class TrainConfig(Section):
    steps: int = _f(100, "optimizer steps", ge=1)
    batch_size: int = _f(32, "global batch = micro_batch_size x accumulation x data-parallel degree", ge=1)
    precision: str = _f("fp32", "fp32, bf16 or fp16 (fp16 needs a GPU)")
    seed: int = _f(0, "seed for weights, data order and augmentation", ge=0)
    output_dir: str = _f("", "run directory: resolved configs, metrics.jsonl, checkpoints, tokenizer; unset = "
                            "runs/<model.type>")
    deepspeed_config: Optional[str] = _f(None, "DeepSpeed JSON whose \"auto\" values are filled from this config; unset = generated")
    save_every: int = _f(0, "checkpoint every N steps (0 = only at the end)", ge=0)
    save: bool = _f(True, "false: write no checkpoint at all, not even at the end (benchmarks and smoke runs; "
                          "transformers' save_strategy=no)")
    save_every_minutes: Optional[float] = _f(None, "also checkpoint at the first step boundary after this many minutes "
                                             "since the last save (rank 0's clock; preemptible jobs)", gt=0)
    collective_timeout_minutes: float = _f(30.0, "a rank that stops answering (hung; or dead, under NCCL) ends the "
                                           "run after this long; under gloo a dead rank's closed connections end it "
                                           "at once", gt=0)
    max_bad_steps: int = _f(3, "stop after this many consecutive steps skipped for non-finite gradients (0 = never; an fp16 overflow that lowers the loss scale does not count)", ge=0)
    eval_every: int = _f(0, "zero-shot retrieval eval every N steps (0 = only at the end)", ge=0)
    resume: Union[bool, str] = _f(False, "false: a fresh run (one into a train.output_dir holding a run is refused); "
                                  "true: continue from the latest checkpoint (= --resume); auto: continue from the "
                                  "newest complete checkpoint if train.output_dir holds one, else start fresh (= "
                                  "--resume auto: the same command starts a job and continues it after a requeue or "
                                  "a restart)")
    keep_checkpoints: int = _f(2, "checkpoints kept on disk (oldest removed); 0 = keep all", ge=0)


@dataclass
class LogConfig(Section):
    progress: bool = _f(True, "progress bar on the reporting rank")
    every: int = _f(1, "print a log line every N steps", ge=1)
    tensorboard: bool = _f(False, "also write TensorBoard events into output_dir/tb")
    grad_norm: bool = _f(True, "log global and per-group gradient norms every step (they are always computed: a "
                               "non-finite norm skips the step); kept for older configs")
    stage_timing: bool = _f(True, "time every pipeline instruction per stage; busy/data/idle fractions per stage in "
                            "metrics.jsonl")
    trace: Optional[list] = _f(None, "[first, last] steps to record as OUTPUT/trace.json (Perfetto/Chrome) and "
                               "OUTPUT/timeline.png, e.g. [5, 6]")
    profile: Optional[list] = _f(None, "[first, last] steps to run under torch.profiler: OUTPUT/profile/rank*.json "
                                 "(Perfetto/Chrome, host and device) and rank*.txt (the ops by device and host time)")
    memory: bool = _f(False, "count every tensor each rank holds during the steps, by category (a dispatch mode counting "
                      "tensor storages; slow: for checking the memory model) and write the peak to OUTPUT/memory/rank*.json")
    grads: Optional[list] = _f(None, "steps whose gradients (every trainable parameter's, fp32, reduced over micro-batches "
                               "and data-parallel ranks, before clipping) are written under the plain parameter names to "
                               "OUTPUT/grads/step*.stage*.safetensors, e.g. [1, 4]: to compare two layouts of a run "
                               "parameter by parameter (mmpipe.train.grad_dump.compare_grads)")
    peak_tflops: Optional[float] = _f(None, "peak TFLOP/s of one device for mfu/hfu in metrics.jsonl; unset = the "
                                      "published dense peak of a known GPU (H100, H200, A100, L40S) at train.precision, "
                                      "else no mfu/hfu", gt=0)


@dataclass
class RunConfig(Section):
    model: Any = field(default_factory=lambda: _model_section()(), metadata={"help": "model definition (its keys "
                                                                              "depend on model.type)"})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "data sources and loader"})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"help": "pipeline / data parallel layout"})
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"help": "optimizer and schedule"})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "training loop"})
    log: LogConfig = field(default_factory=LogConfig, metadata={"help": "logging"})
    # dotted keys set explicitly by the YAML file or --set (used to detect DeepSpeed-JSON conflicts)
    explicit: frozenset = field(default=frozenset(), repr=False, compare=False, metadata={"internal": True})
    source: Optional[str] = field(default=None, repr=False, compare=False, metadata={"internal": True})
    # pretrained-weights keys given as hub ids: {dotted key: org/name@commit} (``config.hub``; the paths hold
    # the snapshot directories, the run's config.yaml the pins)
    hub: dict = field(default_factory=dict, repr=False, compare=False, metadata={"internal": True})

    def to_dict(self) -> dict:
        return _to_dict(self)

    def get(self, dotted: str):
        obj = self
        for part in dotted.split("."):
            obj = getattr(obj, part)
        return obj

    def set(self, dotted: str, value) -> None:
        *head, last = dotted.split(".")
        obj = self
        for part in head:
            obj = getattr(obj, part)
        setattr(obj, last, value)


def _to_dict(obj) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        if f.metadata.get("internal"):
            continue
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            v = _to_dict(v)
        elif isinstance(v, dict) and v and all(dataclasses.is_dataclass(x) for x in v.values()):
            v = {k: _to_dict(x) for k, x in v.items()}
        out[f.name] = v
    return out


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true/false", list: "a list"}


def _check_type(key: str, tp, value, where: str):
    if tp in (str, "str") and value is False and key in _YAML_OFF:  # YAML 1.1 reads a bare off as false
        return "off"
    if tp in (str, "str") and isinstance(value, bool) and key in _choices():  # ... and on / yes / true as true
        typed = "on/yes/true" if value else "off/no/false"
        raise ConfigError(f"{where}: {key}={typed} (YAML's {str(value).lower()}) is not one of "
                          f"{', '.join(_choices()[key])}")
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X] or Union[X, Y]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        if len(args) > 1:
            if any(isinstance(value, a) and not (a is int and isinstance(value, bool)) for a in args):
                return value
            raise ConfigError(f"{where}: {key} must be {' or '.join(_TYPE_NAMES[a] for a in args)}, got {value!r}")
        tp = args[0]
    if isinstance(tp, str):
        tp = eval(tp)  # noqa: S307 - only our own annotations
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "3e-3" and "inf" as strings
        try:
            return float(value.replace(".inf", "inf"))
        except ValueError:
            pass
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{where}: {key} must be {_TYPE_NAMES[int]}, got {value!r}")
    if tp in _TYPE_NAMES and not isinstance(value, tp):
        raise ConfigError(f"{where}: {key} must be {_TYPE_NAMES[tp]}, got {value!r}")
    return value


def _hint(key: str, known) -> str:
    """`` (did you mean 'x'?)`` for the closest known key (difflib's ratio), else the known keys."""
    import difflib
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6) if key else []
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"


def _build(cls, data: dict, prefix: str, where: str, explicit: set, family: str = "clip"):
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: section '{prefix.rstrip('.') or '<top>'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs = {}
    for key, value in data.items():
        dotted = prefix + str(key)
        if key not in known:
            raise ConfigError(f"{where}: unknown key '{dotted}'{_hint(str(key), known)}")
        tp = hints[key]
        if cls is RunConfig and key == "model":
            tp = _model_section(family, where)
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value or {}, dotted + ".", where, explicit, family)
        elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
            vcls = typing.get_args(tp)[1]
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {dotted} must be a mapping of name -> settings")
            defaults = default_groups(family) if key == "groups" else getattr(cls(), key)
            merged = {k: dataclasses.asdict(v) for k, v in defaults.items()}  # defaults stay
            for name, sub in value.items():
                if sub is None:  # `name: null` removes a default group
                    merged.pop(name, None)
                    continue
                if not isinstance(sub, dict):
                    raise ConfigError(f"{where}: {dotted}.{name} must be a mapping (patterns, lr, ...), got {sub!r}")
                merged.setdefault(name, {}).update(sub)
            kwargs[key] = {name: _build(vcls, sub, f"{dotted}.{name}.", where, explicit, family)
                           for name, sub in merged.items()}
            explicit -= {f"{dotted}.{n}.{k}" for n, sub in merged.items() for k in sub
                         if not (isinstance(value.get(n), dict) and k in value[n])}
        else:
            kwargs[key] = _check_type(dotted, tp, value, where)
            explicit.add(dotted)
    return cls(**kwargs)


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set train.steps=10")
    key, raw = item.split("=", 1)
    if not key.strip() or any(not part for part in key.strip().split(".")):
        raise ConfigError(f"--set {item!r}: no key before '=' (expected section.key=value, e.g. --set train.steps=10)")
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(path: Optional[str] = None, overrides=(), weights: bool = True, hub: bool = True) -> RunConfig:
    """Load a YAML run config (or defaults when ``path`` is None) and apply ``section.key=value`` overrides;
    hub ids in its pretrained-weights keys resolved to snapshot directories (``config.hub``; ``weights=False``:
    their configs and tokenizer files only, enough to size the model; ``hub=False``: not at all, for a config
    whose paths are relative to its own directory, as an export's)."""
    data: dict = {}
    where = path or "<defaults>"
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path} (pass --config PATH to a YAML run config)")
        try:
            with open(path) as fh:
                data = yaml.safe_load(fh) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}{line}: not valid YAML ({getattr(e, 'problem', e)})") from None
    for item in overrides:
        key, value = _parse_override(item)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item}: '{part}' is not a section")
        node[parts[-1]] = value
    explicit: set = set()
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    family = model.get("type", "clip")
    if not isinstance(family, str):
        raise ConfigError(f"{where}: model.type must be a string naming a model family, got {family!r}")
    if isinstance(data.get("optim", {}), dict):  # the family's default groups, even when optim is absent
        data.setdefault("optim", {})
        if isinstance(data["optim"].get("groups", {}), dict):
            data["optim"].setdefault("groups", {})
    par = data.get("parallel")
    if isinstance(par, dict) and par.get("pipeline_stages") == "auto":  # P chosen with the rest of the layout
        par["pipeline_stages"] = 1
        par.setdefault("layout", "auto")
    cfg = _build(RunConfig, data, "", where + (" (+ --set)" if overrides else ""), explicit, family)
    cfg.explicit = frozenset(explicit)
    cfg.source = path
    if not cfg.train.output_dir:  # each family's runs apart (a VLM's plan is not written under runs/clip)
        object.__setattr__(cfg.train, "output_dir", os.path.join("runs", family))
    from mmpipe.config.hub import resolve_ids
    cfg.hub = resolve_ids(cfg, weights) if hub else {}  # hub ids -> snapshot directories, before a path is read
    # paths in the config are relative to the working directory, as with deepspeed/accelerate/torchrun
    validate(cfg)
    return cfg


_YAML_OFF = ("parallel.replan",)  # string settings whose choices include "off"
_CHOICES = {
    "train.precision": ("fp32", "bf16", "fp16"),
    "optim.schedule": ("cosine", "constant"),
    "optim.train_type": ("full", "lora"),
    "parallel.activation_checkpointing": ("none", "all", "auto"),
    "data.balance": ("none", "cost"),
    "parallel.replan": ("off", "auto"),
}


def _choices() -> dict:
    """Every setting's choices; ``parallel.schedule``'s from the registry of orders (a plugin's included)."""
    return {**_CHOICES, "parallel.schedule": ("auto",) + tuple(SCHEDULES)}


def check_ranges(section, prefix: str, where: str) -> None:
    """Every number of the config within the range its field declares (``fields.option``), the
    model section and optimizer groups included: one line naming the key and what it accepts."""
    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        subs = v.items() if isinstance(v, dict) else [(None, v)]
        for name, sub in subs:
            if isinstance(sub, Section):
                check_ranges(sub, f"{prefix}{f.name}." + (f"{name}." if name is not None else ""), where)
        rng = f.metadata.get("range")
        if rng and isinstance(v, (int, float)) and not isinstance(v, bool) and not in_range(v, rng):
            help_ = f.metadata.get("help", "")
            raise ConfigError(f"{where}: {prefix}{f.name}={v} is out of range: it accepts {range_text(rng)} "
                              f"({help_})")


def validate(cfg: RunConfig) -> None:
    """Checks that need no process group: choices, ranges, ZeRO with a pipeline."""
    where = cfg.source or "config"
    for key, choices in _choices().items():
        if cfg.get(key) not in choices:
            raise ConfigError(f"{where}: {key}={cfg.get(key)!r} is not one of {', '.join(choices)}")
    placement = cfg.parallel.placement
    if placement not in ("modality", "balanced", "auto", "uniform", "parameters") and not placement.startswith("type:"):
        raise ConfigError(f"{where}: parallel.placement={placement!r} is not one of modality, balanced, auto, uniform, "
                          "parameters, type:REGEX")
    mbs = cfg.parallel.micro_batch_size
    if cfg.parallel.layout not in ("manual", "auto"):
        raise ConfigError(f"{where}: parallel.layout={cfg.parallel.layout!r} is not one of manual, auto")
    if cfg.parallel.layout == "auto" and mbs == "auto":
        raise ConfigError(f"{where}: parallel.layout=auto compares layouts at one micro-batch size: set "
                          "parallel.micro_batch_size to a number")
    if cfg.train.resume not in (True, False, "auto"):
        raise ConfigError(f"{where}: train.resume must be true, false or auto, got {cfg.train.resume!r}")
    if isinstance(mbs, str) and mbs != "auto":
        raise ConfigError(f"{where}: parallel.micro_batch_size must be a positive integer or auto, got {mbs!r}")
    for key, choices in (("data.augment", ("none", "crop", "crop_flip")), ("data.padding", ("batch", "max_length"))):
        if cfg.get(key) not in choices:
            raise ConfigError(f"{where}: {key}={cfg.get(key)!r} is not one of {', '.join(choices)}")
    for key in ("log.trace", "log.profile"):
        tr = cfg.get(key)
        if tr is not None and not (isinstance(tr, list) and len(tr) == 2 and all(isinstance(x, int) for x in tr)
                                   and 1 <= tr[0] <= tr[1]):
            raise ConfigError(f"{where}: {key} must be [first, last] step numbers (1-based), got {tr!r}")
    grads = cfg.log.grads
    if grads is not None and not (isinstance(grads, list) and all(isinstance(x, int) and x >= 1 for x in grads)):
        raise ConfigError(f"{where}: log.grads must be a list of step numbers (1-based), e.g. [1, 4]; got {grads!r}")
    lo_hi = cfg.data.crop_scale
    if not (isinstance(lo_hi, list) and len(lo_hi) == 2 and 0 < lo_hi[0] <= lo_hi[1] <= 1):
        raise ConfigError(f"{where}: data.crop_scale must be [low, high] with 0 < low <= high <= 1, got {lo_hi!r}")
    for key in ("parallel.pipeline_stages", "train.batch_size", "train.steps", "data.max_length", "data.pad_multiple",
                "data.group_window") + (("parallel.micro_batch_size",) if mbs != "auto" else ()):
        if cfg.get(key) < 1:
            raise ConfigError(f"{where}: {key} must be >= 1, got {cfg.get(key)}")
    _check_numbers(cfg, where)
    check_ranges(cfg, "", where)  # every other number, the model section's included
    fam = family_of(cfg)
    fam.validate(cfg.model, where)
    if cfg.data.packing and not fam.packs:
        raise ConfigError(f"{where}: data.packing=true: model.type={cfg.model.type} trains on image-caption pairs, "
                          "which are not packed (packing is for chat data, model.type=vlm); unset data.packing")
    low = fam.min_micro_batch
    if mbs != "auto" and mbs < low:
        raise ConfigError(f"{where}: parallel.micro_batch_size={mbs}: model.type={cfg.model.type} needs at least {low} "
                          f"samples per micro-batch ({fam.min_micro_batch_why}); use {low} or more, or auto")
    if cfg.parallel.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"{where}: parallel.zero_stage must be 0, 1, 2 or 3, got {cfg.parallel.zero_stage}")
    if cfg.parallel.pipeline_stages > 1 and cfg.parallel.zero_stage >= 2:
        raise ConfigError(
            f"{where}: parallel.zero_stage={cfg.parallel.zero_stage} with parallel.pipeline_stages="
            f"{cfg.parallel.pipeline_stages}: DeepSpeed's pipeline engine supports ZeRO 0/1 only "
            "(ZeRO-2/3 partition gradients the pipeline schedule reduces itself); use zero_stage 0 or 1, or pipeline_stages 1")
    if cfg.optim.target_parameters and cfg.optim.train_type != "lora":
        raise ConfigError(f"{where}: optim.target_parameters={cfg.optim.target_parameters} is LoRA's (peft's parameter "
                          f"LoRA) and optim.train_type={cfg.optim.train_type} trains every weight: set "
                          "optim.train_type=lora, or leave target_parameters out")
    ep = cfg.parallel.expert_parallel
    if ep > 1 and not getattr(fam, "routed_experts", False):  # (a MoE family's mark: ``RoutedExperts``)
        raise ConfigError(f"{where}: parallel.expert_parallel={ep}: model.type={cfg.model.type} has no routed experts "
                          "(expert parallelism is for MoE models: qwen3_5_moe, qwen3_vl_moe); set it to 1")
    if ep > 1 and cfg.parallel.zero_stage == 3:
        raise ConfigError(f"{where}: parallel.expert_parallel={ep} with parallel.zero_stage=3: DeepSpeed 0.19.8 "
                          "partitions ZeRO-3 weights over the whole data-parallel group, not per expert shard; "
                          "use zero_stage 0-2 with expert_parallel, or expert_parallel 1 with ZeRO-3")
    refusal = fam.zero3_checkpointing_refusal()
    if cfg.parallel.zero_stage == 3 and cfg.parallel.activation_checkpointing == "all" and refusal:
        raise ConfigError(f"{where}: parallel.zero_stage=3 with parallel.activation_checkpointing=all: model.type="
                          f"{cfg.model.type}: {refusal}; use zero_stage 2, a pipeline "
                          "(pipeline_stages >= 2) with checkpointing, or activation_checkpointing none")
    if cfg.optim.max_grad_norm is not None and cfg.optim.max_grad_norm <= 0:
        raise ConfigError(f"{where}: optim.max_grad_norm must be > 0 (or unset for no clipping), got {cfg.optim.max_grad_norm}")


def _check_numbers(cfg: RunConfig, where: str) -> None:
    """Ranges of the optimizer, schedule and loader numbers (a sign or length mistake is one line)."""
    o = cfg.optim
    betas = o.betas
    if not (isinstance(betas, list) and len(betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1
                                                                for b in betas)):
        raise ConfigError(f"{where}: optim.betas must be [beta1, beta2] with 0 <= beta < 1, got {betas!r}")
    checks = [("optim.lr", o.lr, o.lr >= 0, ">= 0"), ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0"),
              ("optim.eps", o.eps, o.eps > 0, "> 0"), ("optim.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, ">= 0"),
              ("optim.min_lr_ratio", o.min_lr_ratio, 0 <= o.min_lr_ratio <= 1, "between 0 and 1"),
              ("data.num_workers", cfg.data.num_workers, cfg.data.num_workers >= 0, ">= 0 (0 = load in the main process)"),
              ("data.prefetch_factor", cfg.data.prefetch_factor, cfg.data.prefetch_factor >= 1, ">= 1"),
              ("data.max_bad_fraction", cfg.data.max_bad_fraction, 0 <= cfg.data.max_bad_fraction <= 1, "between 0 and 1"),
              ("train.save_every", cfg.train.save_every, cfg.train.save_every >= 0, ">= 0 (0 = only at the end)"),
              ("train.eval_every", cfg.train.eval_every, cfg.train.eval_every >= 0, ">= 0 (0 = only at the end)"),
              ("train.keep_checkpoints", cfg.train.keep_checkpoints, cfg.train.keep_checkpoints >= 0, ">= 0 (0 = all)")]
    for name, group in o.groups.items():
        for field_name in ("lr", "weight_decay", "max_grad_norm"):
            v = getattr(group, field_name)
            if v is not None:
                ok = v > 0 if field_name == "max_grad_norm" else v >= 0
                checks.append((f"optim.groups.{name}.{field_name}", v, ok, "> 0" if field_name == "max_grad_norm" else ">= 0"))
    for key, value, ok, want in checks:
        if not ok:
            raise ConfigError(f"{where}: {key} must be {want}, got {value}")


def reference() -> str:
    """Markdown table of every config key with its default and help (docs/configuration.md's reference)."""
    rows = ["| key | default | meaning |", "|---|---|---|"]

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            if f.metadata.get("internal"):
                continue
            tp = _model_section() if cls is RunConfig and f.name == "model" else typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, prefix + f.name + ".")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if isinstance(default, dict):
                default = {k: dataclasses.asdict(v)["patterns"] for k, v in default.items()}
            helptext = f.metadata.get("help", "").replace("|", "\\|")
            if f.metadata.get("range"):
                helptext += f" [{range_text(f.metadata['range'])}]"
            rows.append(f"| `{prefix}{f.name}` | `{json.dumps(default)}` | {helptext} |")

    walk(RunConfig, "")
    return "\n".join(rows)


def replace(cfg: RunConfig, **changes) -> RunConfig:
    """A new config with ``changes`` ({"section__key": value} or {"model": section}); ``cfg`` is
    left as it is. How a run derives its resolved config (tokenizer fields, auto micro-batch)."""
    out = thawed_copy(cfg)
    for key, value in changes.items():
        out.set(key.replace("__", "."), value)
    return out


def save_yaml(cfg: RunConfig, path: str) -> None:
    with open(path, "w") as fh:
        yaml.safe_dump(cfg.to_dict(), fh, sort_keys=False)
