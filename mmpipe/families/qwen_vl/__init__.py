"""Qwen2.5-VL at native resolution (``model.type: qwen2_5_vl``): every image keeps its aspect ratio and
becomes its own number of tokens (the model's image processor: ``data.min_pixels`` /
``data.max_pixels``), its patches run through the window-attention ViT, the 2x2 merger (ms-swift's
"aligner") and into the Qwen2 decoder at the ``<|image_pad|>`` positions, with multimodal rotary
positions computed per batch in the collate (``positions``: restarting per sample in packed rows).
Arithmetic, weights (``model.pretrained``: a local ``Qwen2_5_VLForConditionalGeneration`` directory with
its processor) and export are transformers'. Chat data, packing, the token-mean loss and generation
come from the chat home (``mmpipe.families.chat``)."""
from __future__ import annotations

import torch
from torch import nn

from mmpipe.config.fields import thawed_copy
from mmpipe.config.registry import register_family
from mmpipe.errors import ConfigError
from mmpipe.families.base import Layer
from mmpipe.families.chat.export_format import no_added_special_tokens, plain_template, set_generation_defaults
from mmpipe.families.chat.family import ChatFamily
from mmpipe.families.chat.layers import LmHead, TokenEmbed
from mmpipe.families.chat.masks import mark_mask
from mmpipe.families.chat.records import ROLE_TOKENS
from mmpipe.families.qwen_vl import model as m
from mmpipe.families.qwen_vl.config import Qwen25VLConfig
from mmpipe.families.qwen_vl.hf_config import HFConfigSpec, build_hf_config, check_mrope
from mmpipe.families.qwen_vl.video import NativeVideo, VideoInput, check_budgets, video_processor
from mmpipe.families.towers import hf
from mmpipe.families.towers.common import init_transformer_part

IMAGE_PAD, VISION_START, VISION_END, VIDEO_PAD = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"


QWEN2_5_VL = HFConfigSpec(
    "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig",
    vision_fields=("depth", "hidden_size", "num_heads", "intermediate_size", "patch_size", "temporal_patch_size",
                   "spatial_merge_size", "window_size", "fullatt_block_indexes"),
    text_fields=("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                 "max_position_embeddings"),
    rope={"rope_theta": 1_000_000.0}, check=lambda top: check_mrope(top.text_config, [16, 24, 24]),
    top_extra={"bos_token_id": None, "eos_token_id": None})


@register_family
class Qwen25VLFamily(ChatFamily):
    name = "qwen2_5_vl"
    config_class = Qwen25VLConfig
    inputs = ("pixel_values", "image_grid_thw", "input_ids", "attention_mask", "position_ids")
    special_tokens = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)  # Qwen2-VL's; a directory's tokenizer has them
    default_groups = {"vision": [r"^vision\."], "merger": [r"^merger\."], "llm": [r"^llm\."]}
    # ms-swift's names (the aligner is the merger), and mmpipe's own
    freeze_shortcuts = {"freeze_vit": "vision", "freeze_aligner": "merger", "freeze_llm": "llm",
                        "freeze_vision": "vision", "freeze_projector": "merger", "freeze_text": "llm"}
    lr_shortcuts = {"vit_lr": "vision", "aligner_lr": "merger"}
    decay_split = 2  # embedding tables undecayed, as the VLM's
    hf_adapter = "QwenVLHF"  # (its transformers names and model class: ``adapter``)
    processor_classes = ("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor")  # what an export saves beside the model
    marker_join = ""  # the chat template renders <|vision_start|>...<|vision_end|> and the text straight after

    @classmethod
    def zero3_checkpointing_refusal(cls) -> str:
        # measured (tiny Qwen2.5-VL and Qwen3.5, DP2, native-resolution micro-batches that differ in images per
        # rank): DeepSpeed's ZeRO-3 hooks and torch's non-reentrant recompute (which stops early where the saved
        # tensors run out) leave the ranks' gradient reductions unequal: the run hangs in backward at step 2-3
        return ("ZeRO-3 with activation checkpointing hangs when data-parallel ranks' micro-batches differ in "
                "images (DeepSpeed's gradient reduce-scatters fall out of step)")

    # ---- config ------------------------------------------------------------------------------------
    @classmethod
    def tokenizer_weights(cls, model_cfg):
        return ("model.pretrained", model_cfg.pretrained) if model_cfg.pretrained else (None, None)

    @classmethod
    def prepare_tokenizer(cls, tokenizer):
        """Qwen2-VL's vision tokens as special tokens (a directory's tokenizer holds them already), and,
        for a tokenizer without a chat template, the plain template's role markers (``<image>`` itself
        never reaches the tokenizer: the encoder expands it)."""
        tokens = cls.special_tokens + (() if getattr(tokenizer, "chat_template", None) else ROLE_TOKENS)
        missing = [t for t in tokens if t not in tokenizer.get_vocab()]
        if missing:
            tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
        return tokenizer

    @classmethod
    def resolve(cls, model_cfg, tokenizer, data_cfg):
        """``model.image_token_id`` (the tokenizer's ``<|image_pad|>``) and ``model.llm.vocab_size`` (at
        least the tokenizer's size), when left unset."""
        out = thawed_copy(model_cfg)
        image_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if out.image_token_id is None:
            out.image_token_id = image_id
        elif out.image_token_id != image_id:
            raise ConfigError(f"model.image_token_id={out.image_token_id} but the tokenizer's {IMAGE_PAD} is {image_id}: "
                              "unset model.image_token_id, or use the model's tokenizer")
        video_id = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
        if out.video_token_id is None:
            out.video_token_id = video_id
        elif out.video_token_id != video_id:
            raise ConfigError(f"model.video_token_id={out.video_token_id} but the tokenizer's {VIDEO_PAD} is {video_id}: "
                              "unset model.video_token_id, or use the model's tokenizer")
        check_budgets(*(getattr(data_cfg, f"video_{k}", None) for k in ("min_frames", "max_frames", "min_pixels",
                                                                        "max_pixels")))
        for key in ("min_pixels", "max_pixels"):  # recorded for what reads no data section (plan, export, generate)
            if getattr(data_cfg, key, None):
                setattr(out, key, getattr(data_cfg, key))
        n = len(tokenizer)
        if out.pretrained:
            size = hf.load_hf_config(out.pretrained, "model.pretrained").text_config.vocab_size
            if n > size:
                out.llm.vocab_size = n
        elif out.llm.vocab_size is None:
            out.llm.vocab_size = n
        elif out.llm.vocab_size < n:
            raise ConfigError(f"model.llm.vocab_size={out.llm.vocab_size} is smaller than the tokenizer's {n} tokens")
        return out

    @classmethod
    def validate(cls, model_cfg, where: str) -> None:
        super().validate(model_cfg, where)
        if not model_cfg.pretrained and (model_cfg.llm.hidden_size is None or model_cfg.llm.num_hidden_layers is None):
            raise ConfigError(f"{where}: model.type={cls.name} needs model.pretrained (a local directory) or the sizes "
                              f"model.llm.hidden_size and model.llm.num_hidden_layers (see configs/{cls.name}*.yaml)")

    @classmethod
    def pixels(cls, model_cfg, data_cfg, seed=None):
        """Native-resolution images through the model's image processor (no augmentation: the
        processor's arithmetic is what an exported model is fed)."""
        from mmpipe.families.qwen_vl.pixels import NativePixels, image_processor
        if data_cfg is not None:  # the square-image settings have no meaning here: one line, not silence
            if getattr(data_cfg, "augment", "none") != "none":
                raise ConfigError(f"data.augment={data_cfg.augment} is not available for model.type={cls.name}: its "
                                  "images go through the model's own processor at native resolution (what an exported "
                                  "model is fed); set data.augment=none")
            if getattr(data_cfg, "decode_size", None):
                raise ConfigError(f"data.decode_size={data_cfg.decode_size} is not available for model.type={cls.name}: "
                                  "each image is decoded in full and resized within data.min_pixels / data.max_pixels; "
                                  "unset data.decode_size")
        if model_cfg.pretrained:
            hf.check_dir(model_cfg.pretrained, "model.pretrained")
        bounds = [getattr(data_cfg, k, None) or getattr(model_cfg, k, None) for k in ("min_pixels", "max_pixels")]
        return NativePixels(image_processor(model_cfg.pretrained, *bounds, cls.processor_defaults(model_cfg))).checked()

    @classmethod
    def processor_defaults(cls, model_cfg) -> dict:
        """The image processor's settings without a directory (transformers' Qwen2-VL defaults: patch 14)."""
        return {}

    @classmethod
    def hf_config(cls, model_cfg):
        """transformers' config of a ``model:`` section (a later Qwen family: its own)."""
        return build_hf_config(model_cfg, QWEN2_5_VL)

    def model_parts(self):
        """(the module whose ``vision_classes`` / ``decoder_block_cls`` build the layers, the decoder's RMSNorm):
        what a later Qwen family swaps; the layer steps (``model``) are every Qwen family's."""
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm
        return m, Qwen2_5_VLRMSNorm

    def __init__(self, model_cfg, seed: int = 0):
        super().__init__(model_cfg, seed)
        self.hf_cfg = self.hf_config(model_cfg)
        self.vision_cfg, self.text_cfg = self.hf_cfg.vision_config, self.hf_cfg.text_config
        self.image_token_id = self.hf_cfg.image_token_id
        self.video_token_id = getattr(self.hf_cfg, "video_token_id", None)
        self.tied = bool(getattr(self.hf_cfg, "tie_word_embeddings", False))
        self._source = hf.WeightSource(model_cfg.pretrained, "model.pretrained") if model_cfg.pretrained else None
        self._native = {}
        D, L = self.vision_cfg.depth, self.text_cfg.num_hidden_layers
        self._layers = ([Layer("vision.embed", "vision", m.vision_embed_step)]
                        + [Layer(f"vision.blocks.{i}", "vision", m.vision_block_step) for i in range(D)]
                        + [Layer("merger", "merger", m.merger_step, takes=("vision",)),
                           Layer("llm.embed", "llm", m.llm_embed_step, takes=("merger",))]
                        + [Layer(f"llm.blocks.{i}", "llm", m.llm_block_step) for i in range(L)]
                        + [Layer("llm.head", "llm", m.llm_head_step)])

    # ---- structure -------------------------------------------------------------------------------------
    def layers(self) -> list:
        return self._layers

    def build_unseeded(self, name: str) -> nn.Module:
        parts, RMSNorm = self.model_parts()
        v, t = self.vision_cfg, self.text_cfg
        PatchEmbed, VisionBlock, Merger = parts.vision_classes()
        if name == "vision.embed":
            module = PatchEmbed(v)
        elif name.startswith("vision.blocks."):
            module = VisionBlock(v, int(name.rsplit(".", 1)[1]))
        elif name == "merger":
            module = Merger(v)
        elif name == "llm.embed":
            module = TokenEmbed(t.vocab_size, t.hidden_size, getattr(t, "pad_token_id", None), self.image_token_id,
                                self.video_token_id)
        elif name.startswith("llm.blocks."):
            module = parts.decoder_block_cls()(t, int(name.rsplit(".", 1)[1]))
        elif name == "llm.head":
            module = LmHead(RMSNorm(t.hidden_size, eps=t.rms_norm_eps), t.hidden_size, t.vocab_size)
        else:
            raise KeyError(name)
        init_transformer_part(module, std=getattr(t, "initializer_range", 0.02))
        for sub in module.modules():  # (init_transformer_part knows Conv2d; the patch embedding is 3-D)
            if isinstance(sub, nn.Conv3d):
                nn.init.normal_(sub.weight, std=getattr(t, "initializer_range", 0.02))
        return module

    def micro_batch(self, batch: dict):
        from mmpipe.families.qwen_vl import products
        return products.micro_batch(self, batch, super().micro_batch(batch))

    def matmuls(self, name: str, mb) -> list:
        from mmpipe.families.qwen_vl import products
        return products.matmuls(self, name, mb)

    def load_pretrained(self, module: nn.Module, name: str) -> None:
        if self._source is None:
            return
        src, sd = self._source, {}
        for k, v in module.state_dict().items():
            mine = f"{name}.{k}"
            if self.tied and mine == "llm.head.lm_head.weight":
                mine = "llm.embed.embed_tokens.weight"
            theirs, w = self.source_weight(src, mine, v.shape)
            if theirs is None:
                raise ConfigError(f"model.pretrained: {src.path} has no weight for {name}.{k}")
            if k in ("embed_tokens.weight", "lm_head.weight") and w.shape[0] < v.shape[0] and w.shape[1:] == v.shape[1:]:
                w = torch.cat([w.to(v.dtype), v[w.shape[0]:]])  # tokens the tokenizer added keep their seeded rows
            if w.shape != v.shape:
                raise ConfigError(f"model.pretrained: weight '{theirs}' in {src.path} has shape {tuple(w.shape)}, the "
                                  f"model expects {tuple(v.shape)} for {name}.{k}")
            sd[k] = w
        module.load_state_dict(sd, strict=True)

    def source_weight(self, src, mine: str, shape) -> tuple:
        """(the directory's name, its tensor) for the weight ``mine`` (``shape``: what the layer holds); (None,
        None) where the directory has none."""
        theirs = self.source_name(src, mine)
        return (theirs, src.get(theirs)) if theirs is not None else (None, None)

    def source_name(self, src, mine: str):
        """The directory's name for ``mine`` (``load_rules``: the saved layout, then the in-memory one), or None."""
        return next((p + mine[len(prefix):] for prefix, names in self.hf.load_rules if mine.startswith(prefix)
                     for p in names if p + mine[len(prefix):] in src), None)

    def tied_weights(self) -> list:
        return [("llm.embed.embed_tokens.weight", "llm.head.lm_head.weight")] if self.tied else []

    @property
    def hf(self):
        from mmpipe.families.qwen_vl import adapter
        return getattr(adapter, self.hf_adapter)(self)

    # ---- data ------------------------------------------------------------------------------------------
    def native(self, data_cfg=None):
        """The image input for ``data_cfg``'s bounds (kept: ``image_tokens`` asks per image)."""
        key = (getattr(data_cfg, "min_pixels", None), getattr(data_cfg, "max_pixels", None))
        if key not in self._native:
            self._native[key] = self.pixels(self.cfg, data_cfg)
        return self._native[key]

    def image_tokens(self, image, data_cfg=None) -> int:
        return self.native(data_cfg).tokens(image)

    def image_wrap(self, tokenizer) -> tuple:
        return [tokenizer.convert_tokens_to_ids(VISION_START)], [tokenizer.convert_tokens_to_ids(VISION_END)]

    def batch_units(self, batch: dict) -> tuple:
        """(image and video tokens, token slots)."""
        ids = batch["input_ids"]
        visual = (ids == self.image_token_id) | (ids == self.video_token_id)
        return float(visual.sum()), float(ids.numel())

    video_style = "qwen2"  # one item per video, time positions scaled (Qwen3 families: an item per temporal patch)

    def native_video(self, data_cfg=None):
        """The video input's frames side (``video.NativeVideo``) for ``data_cfg``'s sampling settings."""
        keys = ("video_fps", "video_min_frames", "video_max_frames", "video_min_pixels", "video_max_pixels")
        key = tuple(getattr(data_cfg, k, None) for k in keys)
        memo = self.__dict__.setdefault("_videos", {})
        if key not in memo:
            proc = video_processor(self.cfg.pretrained, self.video_style, self.processor_defaults(self.cfg), data_cfg)
            memo[key] = NativeVideo(proc, self.video_style, frames_fps=float(proc.fps),
                                    tokens_per_second=float(getattr(self.vision_cfg, "tokens_per_second", 2) or 2))
        return memo[key]

    def video_input(self, tokenizer, data_cfg=None):
        ids = tokenizer.convert_tokens_to_ids([VISION_START, VISION_END, VIDEO_PAD])
        return VideoInput(self.native_video(data_cfg), tokenizer, *ids)

    def collate(self, tokenizer, data_cfg):
        from mmpipe.families.qwen_vl.data import RopeCollate
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return RopeCollate(pad, self.pixels(self.cfg, data_cfg), data_cfg.pad_multiple,
                           data_cfg.max_length if data_cfg.padding == "max_length" else None,
                           image_id=self.image_token_id, merge=self.vision_cfg.spatial_merge_size,
                           video_id=self.video_token_id)

    def example_batch(self, micro_batch_size: int, max_length: int, device, packed: bool = False, grid=None) -> dict:
        """Rows of ``max_length`` tokens, each with one image of ``grid`` (default: the largest
        ``max_pixels`` allows, capped to fit the row) wrapped in its vision tokens."""
        from mmpipe.families.qwen_vl.positions import rope_positions
        px = self.native()
        merge = self.vision_cfg.spatial_merge_size
        if grid is None:
            _, gh, gw = px.example(1, torch.Generator())["image_grid_thw"][0].tolist()
            while gh * gw // merge ** 2 > max(max_length - 3, 1) and gh > merge:
                gh, gw = max(gh - merge, merge), max(gw - merge, merge)
            grid = (1, gh, gw)
        n_img = grid[0] * grid[1] * grid[2] // merge ** 2
        g = torch.Generator().manual_seed(0)
        T = max(max_length, n_img + 3)
        ids = torch.randint(0, self.text_cfg.vocab_size, (micro_batch_size, T), generator=g)
        ids[(ids == self.image_token_id) | (ids == self.video_token_id)] = 0  # (random text holds no visual token)
        ids[:, 1:1 + n_img] = self.image_token_id
        mask = torch.ones_like(ids)
        if packed:
            mask[:, T // 2:] = 2
        pix = px.example(micro_batch_size, g, grid)
        pos = rope_positions(ids, pix["image_grid_thw"], mask, self.image_token_id, merge)
        mask = mask.to(device)
        mark_mask(mask, "packed" if packed else "causal")
        grid = m.mark_grid(pix["image_grid_thw"].to(device), pix["image_grid_thw"])  # (values kept for meta)
        return {"pixel_values": pix["pixel_values"].to(device), "image_grid_thw": grid,
                "input_ids": ids.to(device), "attention_mask": mask, "position_ids": pos.to(device),
                "labels": ids.to(device)}

    def example_batches(self, micro_batch_size: int, max_length: int, device, packed: bool = False,
                        data_cfg=None) -> list:
        """Times at the image sizes the training data holds: its first records' images (headers only)
        in four groups by token count, each profiled at its middle image's grid and weighted by its
        share (text-only samples are not counted: the tower is priced as if every row held an image);
        memory at the largest grid ``max_pixels`` allows (weight 0: the worst case a stage must hold)."""
        worst = self.example_batch(micro_batch_size, max_length, device, packed)
        video = self.video_budget_grid(data_cfg, max_length)
        image = getattr(worst["image_grid_thw"], "_mmpipe_grid", worst["image_grid_thw"])  # (host values on meta)
        if video is not None and video[0] * video[1] * video[2] > int(image[0].prod()):
            worst = self.example_batch(micro_batch_size, max_length, device, packed, grid=video)
        grids = self.data_grids(data_cfg) if getattr(data_cfg, "train", None) else []
        if not grids:
            return [(1.0, worst)]
        merge = self.vision_cfg.spatial_merge_size
        grids.sort(key=lambda g: g[1] * g[2])
        k = max(1, len(grids) // 4)
        groups = [grids[i:i + k] for i in range(0, len(grids), k)]
        return [(0.0, worst)] + [(len(g) / len(grids),
                                  self.example_batch(micro_batch_size, max_length, device, packed, grid=g[len(g) // 2]))
                                 for g in groups if g[len(g) // 2][1] * g[len(g) // 2][2] // merge ** 2 < max_length - 2]

    def data_grids(self, data_cfg, limit: int = 256) -> list:
        """The ``(t, h, w)`` grids of the images and videos of ``data.train``'s first ``limit`` records (headers
        only; an unreadable file is left out)."""
        from PIL import Image
        px, out = self.native(data_cfg), []
        for rec in self.read_records(data_cfg.train, data_cfg, "data.train")[:limit]:
            for path in rec.images:
                try:
                    with Image.open(path) as im:
                        out.append(px.grid(*im.size))
                except (OSError, ValueError, SyntaxError):
                    continue
            for source in getattr(rec, "videos", ()):
                try:
                    out.append(tuple(self.native_video(data_cfg).plan(source).grid))
                except Exception:  # noqa: BLE001 - an unreadable video is the loader's to report
                    continue
        return out

    def video_budget_grid(self, data_cfg, max_length: int):
        """The largest video the frame budget (``data.video_max_frames``, set) and pixel budget allow: a square
        video at that many frames, resized by the video processor (what the memory plan must hold); None without
        a frame budget."""
        frames = getattr(data_cfg, "video_max_frames", None)
        if not frames:
            return None
        native = self.native_video(data_cfg)
        frames = max(frames - frames % native.temporal, native.temporal)
        side = 8192  # (resized down to the budget)
        h, w = native._resized(frames, side, side)
        return (frames // native.temporal, h // native.patch, w // native.patch)

    # ---- generation and export ------------------------------------------------------------------------
    def generation_inputs(self, images: list, data_cfg=None, videos=()) -> dict:
        px, done = self.native(data_cfg), []
        for path in images:
            pixels, why = px.load(path, "image", 0, 0)
            if pixels is None:
                raise ConfigError(f"{path}: {why}")
            done.append(pixels)
        out = px.batch(done) if done else {}
        if videos:
            try:
                out.update(self.native_video(data_cfg).model_inputs(list(videos)))
            except ValueError as e:
                raise ConfigError(f"{', '.join(map(str, videos))}: {e}") from None
        return out

    def generation_kwargs(self, input_ids, image_inputs: dict) -> dict:
        """transformers' Qwen models derive their 3-D positions from ``mm_token_type_ids`` (1 = image, 2 = video)."""
        if not image_inputs:
            return {}
        types = (input_ids == self.image_token_id).to(torch.int32) + 2 * (input_ids == self.video_token_id).to(torch.int32)
        return {**image_inputs, "mm_token_type_ids": types}

    def hf_export(self, state, tokenizer, data_cfg=None):
        """The family's transformers model + processor (``Qwen2_5_VLForConditionalGeneration`` +
        ``Qwen2_5_VLProcessor``: the run's image processor, tokenizer and chat template)."""
        import transformers

        stop = self.encoder(tokenizer, 1).end_of_turn_ids()  # before the template is set: as training rendered
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = plain_template(VISION_START + IMAGE_PAD + VISION_END)
        cfg = self.hf_cfg
        for key, tok in (("vision_start_token_id", VISION_START), ("vision_end_token_id", VISION_END),
                         ("video_token_id", VIDEO_PAD)):
            setattr(cfg, key, tokenizer.convert_tokens_to_ids(tok))
        no_added_special_tokens(tokenizer)
        processor = getattr(transformers, self.processor_classes[0])
        proc = processor(image_processor=self.native(data_cfg).processor, tokenizer=tokenizer,
                         video_processor=self.native_video(data_cfg).processor,  # (the run's frame and pixel budgets)
                         chat_template=getattr(tokenizer, "chat_template", None))
        model = self.hf.hf_model(state)
        set_generation_defaults(model, tokenizer, stop)
        return model, proc
