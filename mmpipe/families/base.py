"""The model-family interface. A family turns its resolved ``model:`` config into an ordered list
of layers (each a plain-model name prefix, a segment tag and a tuple-in/tuple-out step), and says
how samples become batches, which batch fields go to the first stage and which (labels) to the
last, how the loss and the evaluation are computed, and how its weights map to transformers.

Parallelism, planning and the training loop use only this interface: the plain model (P = 1),
the pipeline layers (P >= 2), the profiler and the checkpoint reader are all built from
``layers()`` and ``build_layer(name)``, so a layer's weights and arithmetic are the same in
every layout. The interface is modality-agnostic; ``ImageTextFamily`` (``image_text.py``) adds the
image-caption data defaults. Adding a family = subclass one of them, decorate it with
``mmpipe.families.register_family``, give it a config dataclass (see ARCHITECTURE.md).
"""
from __future__ import annotations

from typing import Callable, ClassVar, NamedTuple, Optional

import torch
from torch import nn

from mmpipe.config.groups import resolve_groups
from mmpipe.errors import NoHFFormat
from mmpipe.families.lora import inject, spec_from
from mmpipe.families.products import Matmul, MicroBatch  # noqa: F401 - part of the family interface
from mmpipe.families.towers.common import part_seed


class HFAdapter:
    """How a family's weights meet transformers' (``Family.hf``): ``hf_config()``, ``to_hf`` / ``from_hf``,
    ``hf_model``; ``adapter_name`` (a plain LoRA parameter name -> peft's inside the transformers model) on
    a family whose LoRA runs export as peft adapter directories, else None."""

    adapter_name = None

    def __init__(self, family):
        self.family = family


class Layer(NamedTuple):
    """One pipeline layer. ``name``: the plain model's parameter-name prefix (its weights are
    ``<name>.<key>`` in every checkpoint); ``segment``: the tag placement keeps stages apart by
    (vision, projector, text, llm, head...); ``step(module, acts)``: the layer on the activation
    tuple (floating-point tensors first, integer tensors last); ``takes``: other segments whose
    tensors this layer computes on (where branches merge: CLIP's loss, a VLM's projector merge);
    ``eval_step``: the step in evaluation, where it differs (CLIP's loss layer hands out the
    features its evaluator scores instead of the loss)."""
    name: str
    segment: str
    step: Callable
    takes: tuple = ()
    eval_step: Optional[Callable] = None


class Family:
    """Base class of a model family (see the module docstring)."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type] = None
    inputs: ClassVar[tuple] = ()  # batch fields -> first stage
    labels: ClassVar[tuple] = ()  # batch fields -> last stage (``loss(outputs, *labels)``)
    min_micro_batch: ClassVar[int] = 1
    min_micro_batch_why: ClassVar[str] = ""
    default_groups: ClassVar[dict] = {}  # group name -> parameter-name regexes
    freeze_shortcuts: ClassVar[dict] = {}  # optim.<flag> -> group it freezes
    lr_shortcuts: ClassVar[dict] = {}  # optim.<key> -> group whose lr it sets (ms-swift's vit_lr, aligner_lr)
    special_tokens: ClassVar[tuple] = ()  # tokens the tokenizer must hold as single special tokens
    # the activations' shapes change between micro-batches (e.g. the number of images): the
    # pipeline engine then sends tensor shapes with every activation
    dynamic_shapes: ClassVar[bool] = False
    # the loss is a mean over units (e.g. label tokens) of the whole global batch, not a mean of
    # per-micro-batch means: ``loss_units`` counts them and ``loss`` takes the normaliser
    token_mean: ClassVar[bool] = False
    packs: ClassVar[bool] = False  # data.packing: several samples per sequence
    data_format: ClassVar[str] = ""  # what it trains on: "captions" (image-caption pairs), "chat"
    generates: ClassVar[bool] = False  # mmpipe generate answers with it (chat families)
    # how its parameters split into decayed / undecayed optimizer groups, recorded with checkpoints
    # (a checkpoint of another split resumes through the layout-free path)
    decay_split: ClassVar[int] = 1
    # a mixin of methods the single-process model offers besides forward (CLIP's encode_image /
    # encode_text); ``mmpipe.parallel.plain.plain_model`` mixes it into its ``PlainModel``
    plain_api: ClassVar[Optional[type]] = None

    # ---- config: class methods, no model built ------------------------------------------------
    @classmethod
    def zero3_checkpointing_refusal(cls) -> str:
        """Why ZeRO-3 with activation checkpointing cannot train this family ("" where it can): the config
        check refuses it in one line and the layout chooser leaves it out."""
        return ""

    @classmethod
    def validate(cls, model_cfg, where: str) -> None:
        """Choices and ranges of the ``model:`` section (one-line ConfigError)."""

    @classmethod
    def pixels(cls, model_cfg, data_cfg, seed: Optional[int] = None):
        """How the family's images become tower input (``mmpipe.data.pixels``: ``load`` / ``finish`` an
        image, ``batch`` a micro-batch's, ``cache_size`` of a preprocessed cache), with ``seed``
        (training data) its augmentation; None: the family reads no images. The data layer asks this
        object, never an image size."""
        return None

    @classmethod
    def tokenizer_weights(cls, model_cfg) -> tuple:
        """(config key, directory) of pretrained text weights whose tokenizer the run must use."""
        return None, None

    @classmethod
    def resolve(cls, model_cfg, tokenizer, data_cfg):
        """A new ``model:`` section with the fields left to the tokenizer filled (never mutates)."""
        return model_cfg

    # ---- data: class methods (read before any model is built) ---------------------------------
    @classmethod
    def read_records(cls, path: str, data_cfg, key: str) -> list:
        """The training / val records of ``path`` (``key`` names it in errors)."""
        raise NotImplementedError

    @classmethod
    def record_texts(cls, records: list) -> list:
        """Texts to train a tokenizer on."""
        raise NotImplementedError

    @classmethod
    def prepare_tokenizer(cls, tokenizer):
        """Give the tokenizer what the family needs (in place, deterministically: every process
        gets the same ids): by default its ``special_tokens``."""
        missing = [t for t in cls.special_tokens if t not in tokenizer.get_vocab()]
        if missing:
            tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
        return tokenizer

    @classmethod
    def check_source(cls, kind: str) -> None:
        """Refuse a data source kind (manifest, cache, shards) the family cannot read (one line)."""

    @classmethod
    def check_data(cls, path: str, cfg, as_json: bool = False, workers: int = 1):
        """``mmpipe data check`` for a family reading its own data format: an exit code, or None for
        the image-caption manifest check (``mmpipe.data.check``)."""
        return None

    def __init__(self, model_cfg, seed: int = 0):
        self.cfg = model_cfg
        self.seed = seed
        self.lora = None  # a LoraSpec (optim.train_type: lora): adapters on the trained layers (use_lora)

    def use_lora(self, optim_cfg) -> None:
        """Build the trained layers with LoRA adapters (``optim.train_type: lora``; no-op for full)."""
        self.lora = None
        self.lora = spec_from(optim_cfg, self, resolve_groups(optim_cfg, type(self)))

    # ---- structure ----------------------------------------------------------------------------
    def layers(self) -> list:
        raise NotImplementedError

    def build_unseeded(self, name: str) -> nn.Module:
        """The layer's module with fresh (unseeded) weights; built on the meta device to size it."""
        raise NotImplementedError

    def load_pretrained(self, module: nn.Module, name: str) -> None:
        """Fill a freshly built layer from the configured local pretrained weights, if any."""

    def build_layer(self, name: str) -> nn.Module:
        """The layer seeded from (seed, name): identical in one process and on any pipeline stage."""
        with part_seed(self.seed, name):
            module = self.build_unseeded(name)
        # not when all weights come from elsewhere (an export), nor on the meta device (sizing: nothing to fill,
        # and a hub id's weights need not be there: ``config.hub``)
        on_meta = any(True for _ in module.parameters()) and all(p.is_meta for p in module.parameters())
        if not getattr(self, "skip_pretrained", False) and not on_meta:
            self.load_pretrained(module, name)
        return self._add_adapters(module, name)

    def _add_adapters(self, module: nn.Module, name: str) -> nn.Module:
        if self.lora is not None and name in self.lora.layers:
            return inject(module, self.lora, part_seed(self.seed, f"lora:{name}"), name)
        return module

    def layer_names(self) -> list:
        return [layer.name for layer in self.layers()]

    def layer(self, name: str) -> Layer:
        for layer in self.layers():
            if layer.name == name:
                return layer
        raise KeyError(name)

    def segments(self) -> list:
        return [layer.segment for layer in self.layers()]

    def segment_graph(self) -> dict:
        """{segment: segments it feeds}, from the layers' ``takes``."""
        graph = {seg: [] for seg in dict.fromkeys(self.segments())}
        for layer in self.layers():
            for src in layer.takes:
                if src != layer.segment and layer.segment not in graph[src]:
                    graph[src].append(layer.segment)
        return graph

    def upstream(self) -> dict:
        """{layer: every layer whose outputs reach it}: the previous layer of its own segment and
        what reaches that, and the last layer of each segment it ``takes`` from and what reaches
        that (transitively: a decoder block after a VLM's merge has the projector and the vision
        tower upstream)."""
        out, last = {}, {}
        for layer in self.layers():
            ups: set = set()
            for src in ([layer.segment] if layer.segment in last else []) + [t for t in layer.takes if t in last]:
                ups |= out[last[src]] | {last[src]}
            out[layer.name] = ups
            last[layer.segment] = layer.name
        return out

    def meta_params(self) -> dict:
        """{layer name: {plain parameter name: numel}}, built on the meta device (no memory, no I/O)."""
        out = {}
        for name in self.layer_names():
            with torch.device("meta"):
                m = self._add_adapters(self.build_unseeded(name), name)
            out[name] = {f"{name}.{k}": p.numel() for k, p in m.named_parameters()}
        return out

    # ---- what a sample costs (``data.balance: cost``: ``mmpipe.data.balance``) ---------------------
    def cost_driver(self, segment: str) -> str:
        """What a layer of ``segment`` computes on: ``vision`` (its time scales with a micro-batch's
        vision units: the image tower) or ``tokens`` (with its token slots, rows x padded length)."""
        return "vision" if segment == "vision" else "tokens"

    def batch_units(self, batch: dict) -> tuple:
        """(vision units, token slots) of a batch dict: one unit per image (a dual encoder's fixed-size
        images), ``input_ids``' rows x length. A family with image tokens counts those."""
        ids, pixels = batch.get("input_ids"), batch.get("pixel_values")
        return (float(pixels.shape[0]) if torch.is_tensor(pixels) else 0.0,
                float(ids.numel()) if torch.is_tensor(ids) else 0.0)

    # ---- arithmetic (analytic FLOPs: ``mmpipe.planning.flops``) ----------------------------------
    def micro_batch(self, batch: dict) -> MicroBatch:
        """The shape of a micro-batch of ``collate``'s batch dict, from its tensors' shapes only
        (``input_ids`` rows and length, ``pixel_values`` images)."""
        ids, pixels = batch.get("input_ids"), batch.get("pixel_values")
        rows, seq_len = (tuple(ids.shape) + (1,))[:2] if torch.is_tensor(ids) else (0, 0)
        return MicroBatch(int(rows), int(seq_len), int(pixels.shape[0]) if torch.is_tensor(pixels) else 0)

    def matmuls(self, name: str, mb: MicroBatch) -> list:
        """The matrix products (``Matmul``) of layer ``name``'s forward on micro-batch ``mb``, as its
        kernels compute them (padding included); raises NotImplementedError for a family that does
        not describe its arithmetic (its runs then log no TFLOP/s)."""
        raise NotImplementedError

    def hf_export(self, state: dict, tokenizer, data_cfg=None) -> tuple:
        """(transformers model holding ``state``, processor) for ``mmpipe export`` (``data_cfg``: the run's
        data section, e.g. the image bounds a native-resolution processor keeps); raises
        ``mmpipe.errors.NoHFFormat`` (saying why) when no transformers class computes the same outputs,
        and ``mmpipe export`` writes mmpipe's own format instead."""
        raise NoHFFormat(f"model.type={self.name} has no transformers format")

    def preprocessor(self):
        """The image processor matching this family's preprocessing (saved with an export), or None."""
        return None

    def tied_weights(self) -> list:
        """[(plain name, plain name)] of parameters that are one (e.g. input embedding and LM head)."""
        return []

    # ---- loss and evaluation ------------------------------------------------------------------
    def loss(self, outputs, *labels) -> torch.Tensor:
        """The scalar loss from the last layer's outputs and the label fields (families whose last
        layer computes the loss itself have no labels and never get here)."""
        raise NotImplementedError

    def evaluate(self, outputs: list, labels: list, samples: list) -> dict:
        """Metrics from the last layer's eval-mode outputs (one per micro-batch), the label fields of
        the same micro-batches and the val samples (padded batches: only ``len(samples)`` rows count)."""
        return {}

    # Optional ``eval_stats(outputs, *labels) -> tensor``: a family that scores against its labels
    # reduces each eval micro-batch to a fixed-size tensor on the last stage (e.g. summed loss,
    # tokens, correct tokens), and ``evaluate`` gets those instead of the last layer's outputs.
    eval_stats = None

    def eval_line(self, record: dict) -> str:
        """The one-line summary of an eval record the trainer prints (None: its numbers, in order)."""
        return None

    # ---- what a family adds to each step's metrics --------------------------------------------------
    def begin_step(self) -> None:
        """A training step begins (a family summing its own step metrics starts them again)."""

    def step_columns(self, device) -> Optional[torch.Tensor]:
        """This rank's sums of the family's step metrics (a 1-D float64 tensor of a fixed length on every rank,
        gathered with the step's other counters), or None: the family logs nothing of its own."""
        return None

    def step_record(self, columns) -> dict:
        """The step record's fields from every rank's ``step_columns`` (world x columns, host values)."""
        return {}

    # ---- a loss over the whole step ---------------------------------------------------------------
    @property
    def step_loss(self) -> bool:
        """The loss of a step spans its whole global batch (every micro-batch of every data-parallel
        rank: a contrastive loss's negatives), not a mean of per-micro-batch losses. The runners then
        cache the last layer's features (its ``eval_step`` output, one row per sample) in a
        forward-only pass, compute ``batch_loss`` over all of them, and train each micro-batch on a
        surrogate with the same gradients (``mmpipe.parallel.step_loss``)."""
        return False


    @property
    def step_loss_pair_bytes(self) -> Optional[int]:
        """Bytes per (image, text) pair autograd holds through the whole step loss (``planning.memory``); None: the
        memory model's default."""
        return None

    @property
    def local_step_loss(self) -> bool:
        """The step loss splits into shares of rows (``batch_loss_grads(rows=...)``) that sum to it and
        to its gradients: each data-parallel rank computes only its own samples' share, and the feature
        gradients are summed across ranks (``parallel.step_loss``); otherwise each computes all of it."""
        return False

    def batch_loss(self, loss_module: nn.Module, features: torch.Tensor, rows=None, cols=None) -> torch.Tensor:
        """With ``step_loss``: the loss of a whole batch's features (rows = samples), computed by
        calling ``loss_module`` (the last layer's module, which holds the loss's parameters). With
        ``local_step_loss`` and ``rows`` = (start, stop): a function of the parameters whose gradient
        is those rows' share (``cols``: what ``batch_loss_grads``'s ``combine`` returned)."""
        raise NotImplementedError

    # rows of the B x B term ``batch_loss_grads`` holds at once (0: all B; the memory model's block)
    step_loss_block_rows = 0

    def batch_loss_grads(self, loss_module: nn.Module, features: torch.Tensor, params: list, rows=None,
                         combine=None) -> tuple:
        """``batch_loss`` with its gradient for ``features`` and for each of ``params`` (the loss
        module's trainable parameters; None where unused): (loss, feature grad, [param grads]).
        Here by autograd through the whole loss; a family may compute it in blocks. With
        ``local_step_loss``: ``rows`` = (start, stop) gives only those rows' share of the loss and of every
        gradient, ``combine(partial)`` completing from the other shares what a share needs of them
        (a collective over the data-parallel group)."""
        if rows is not None:
            raise NotImplementedError(f"{type(self).__name__} does not split its step loss into rows")
        with torch.enable_grad():
            feats = features.detach().clone().requires_grad_(True)
            loss = self.batch_loss(loss_module, feats)
            grads = torch.autograd.grad(loss, [feats] + list(params), allow_unused=True)
        return loss, grads[0], list(grads[1:])

    # ---- data ---------------------------------------------------------------------------------
    def dataset(self, records: list, tokenizer, data_cfg, seed: Optional[int] = None):
        """The indexable dataset of ``records`` (items for ``collate``); ``seed``: training data, whose
        augmentation draws are seeded by it (None: evaluation, no augmentation)."""
        raise NotImplementedError

    def loss_units(self, *labels) -> int:
        """With ``token_mean``: how many units (label tokens) a micro-batch's loss sums over."""
        raise NotImplementedError

    def collate(self, tokenizer, data_cfg):
        """The collate function run in loader workers: decoded samples -> batch dict holding the
        ``inputs`` and ``labels`` fields (plus ``index``, ``keys``, ``bad``). Must be picklable."""
        raise NotImplementedError

    def example_batch(self, micro_batch_size: int, max_length: int, device, packed: bool = False) -> dict:
        """A batch of the configured shapes (inputs and labels) for the profiler: timing does not
        depend on the values. ``packed`` (``data.packing``, a family that ``packs``): rows of several samples."""
        raise NotImplementedError

    def example_batches(self, micro_batch_size: int, max_length: int, device, packed: bool = False,
                        data_cfg=None) -> list:
        """``[(weight, batch)]``: the distribution of micro-batch shapes the family's data gives (a
        variable-resolution family: several image sizes, read from ``data_cfg``'s records); the profiler
        weighs each layer's times by it and keeps the largest memory (a weight-0 shape: priced for memory
        only). One shape (``example_batch``) by default."""
        return [(1.0, self.example_batch(micro_batch_size, max_length, device, packed=packed))]
