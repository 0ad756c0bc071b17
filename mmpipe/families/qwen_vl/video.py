"""Video input of the Qwen families (``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_5``): a file decoded by PyAV (FFmpeg,
bundled with its wheel; transformers' ``load_video(backend="pyav")``) or a directory of frames, sampled and
resized by the model directory's own video processor (``Qwen2VLVideoProcessor`` / ``Qwen3VLVideoProcessor``:
``fps``, ``min_frames`` / ``max_frames``, the pixel bounds), so an exported model fed the same frames by its
processor sees the same patches.

What a video becomes:

- **Qwen2.5-VL**: one visual item of grid ``(T, h, w)`` (T temporal patches of 2 frames), its tokens wrapped once
  in ``<|vision_start|>`` / ``<|vision_end|>``; the rotary time index of temporal patch t is
  ``t x tokens_per_second x second_per_grid_t`` (``second_per_grid_t = 2 / sampled fps``).
- **Qwen3-VL / Qwen3.5**: T visual items of grid ``(1, h, w)`` (the ViT attends within each frame either way),
  each after the text ``<{seconds:.1f} seconds>`` and wrapped in its own vision tokens, the whole video inside one
  more pair (transformers' ``Qwen3VLProcessor`` keeps the chat template's wrapper: what an exported model sees).

The token counts come from the header (frame count, rate, size) and the processor's arithmetic, without decoding
(``plan``), so lengths, packing, ``data check``, the cost balancer and the memory model see a video's real tokens
and patches; the frames are decoded only when the sample is loaded. A file that cannot be read is the sample's
error (named, skipped, counted), never a crash.
"""
from __future__ import annotations

import math
import os
import re
from typing import NamedTuple, Optional

import numpy as np
import torch

from mmpipe.errors import ConfigError

FRAME_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


class VideoPlan(NamedTuple):
    indices: tuple  # the frames sampled (of the file; of the directory's sorted frames)
    fps: float  # the source's frame rate
    sampled_fps: float
    grid: tuple  # (T temporal patches, h, w) patches
    timestamps: tuple  # seconds of each temporal patch (Qwen3 families)


def natural_key(name: str) -> tuple:
    """Sort key of a file name with its digit runs compared as numbers (``frame_2`` before ``frame_10``, as
    ``ls -v``; zero-padded names sort as before)."""
    return tuple((0, int(p), p) if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name) if p)


def frame_files(source) -> list:
    """The frames of a directory (in natural order: frame extractors' ``%d`` names are not zero-padded) or of a
    list of frame files (in order)."""
    if isinstance(source, (list, tuple)):
        return list(source)
    names = [f for f in os.listdir(source) if f.lower().endswith(FRAME_SUFFIXES)]
    return [os.path.join(source, f) for f in sorted(names, key=natural_key)]


def count_frames(container, stream) -> int:
    """A video stream's frame count: its header's, or where the container records none (WebM, Matroska: 0) its
    packets counted (demuxed, not decoded: one packet a frame)."""
    n = int(stream.frames)
    if n > 0:
        return n
    return sum(1 for packet in container.demux(stream) if packet.size)


def is_frames(source) -> bool:
    return isinstance(source, (list, tuple)) or os.path.isdir(source)


class NativeVideo:
    """``processor``: the directory's video processor (transformers'), with the run's sampling settings applied;
    ``style``: ``"qwen2"`` (one item, scaled time positions) or ``"qwen3"`` (an item per temporal patch, timestamp
    text); ``frames_fps``: the rate a directory of frames was taken at. Picklable (loader workers)."""

    def __init__(self, processor, style: str, frames_fps: float = 2.0, tokens_per_second: float = 2.0):
        self.processor, self.style, self.frames_fps = processor, style, float(frames_fps)
        self.tokens_per_second = float(tokens_per_second)
        p = processor
        self.patch, self.merge, self.temporal = int(p.patch_size), int(p.merge_size), int(p.temporal_patch_size)

    # ---- header only -------------------------------------------------------------------------------------
    def metadata(self, source: str):
        """transformers' ``VideoMetadata`` from the container's header (as its PyAV reader fills it), or a frames
        directory's (its count, the first frame's size, ``frames_fps``)."""
        from transformers.video_utils import VideoMetadata
        if is_frames(source):
            from PIL import Image
            files = frame_files(source)
            if not files:
                raise ValueError(f"no frames ({', '.join(FRAME_SUFFIXES)}) in the directory")
            with Image.open(files[0]) as im:
                w, h = im.size
            return VideoMetadata(total_num_frames=len(files), fps=self.frames_fps, duration=len(files) / self.frames_fps,
                                 video_backend="frames", height=h, width=w)
        import av
        with av.open(source) as container:
            stream = container.streams.video[0]
            n, rate = count_frames(container, stream), stream.average_rate
            return VideoMetadata(total_num_frames=n, fps=float(rate), duration=float(n / rate if rate else 0),
                                 video_backend="pyav", height=stream.height, width=stream.width)

    def plan(self, source: str) -> VideoPlan:
        """The frames sampled and the patch grid they become (the processor's ``sample_frames`` and resize
        arithmetic), from the header alone."""
        meta = self.metadata(source)
        if meta.total_num_frames < 1:
            raise ValueError("the video has no frames")
        if meta.total_num_frames < self.temporal:
            raise ValueError(f"{meta.total_num_frames} frame: a video needs at least {self.temporal} (one temporal "
                             "patch)")
        p = self.processor
        try:  # a frames directory was taken at data.video_fps (frames_fps): the budgets sample it as they do a file
            indices = [int(i) for i in p.sample_frames(meta, fps=p.fps)]
        except ZeroDivisionError:  # (Qwen2-VL's sampler rounds to no temporal patch and divides by it)
            indices = []
        n = len(indices)
        if n < self.temporal:
            raise ValueError(f"{n} of its {meta.total_num_frames} frames sampled at {p.fps} a second: a video needs at "
                             f"least {self.temporal} (one temporal patch); raise data.video_fps or data.video_min_frames")
        meta.frames_indices = np.asarray(indices)
        h, w = self._resized(n, meta.height, meta.width)
        grid = (-(-n // self.temporal), h // self.patch, w // self.patch)
        stamps = ()
        if self.style == "qwen3":
            from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
            stamps = tuple(Qwen3VLProcessor._calculate_timestamps(None, list(indices), meta.fps, self.temporal))
        return VideoPlan(tuple(indices), float(meta.fps), float(meta.sampled_fps), grid, stamps)

    def _resized(self, frames: int, height: int, width: int) -> tuple:
        """(height, width) the processor resizes ``frames`` frames of ``height`` x ``width`` to (its ``resize``)."""
        p, factor = self.processor, self.patch * self.merge
        lo, hi = int(p.size["shortest_edge"]), int(p.size["longest_edge"])
        cap = bool(getattr(p, "cap_pixels_per_frame", None))
        if type(p).__name__.startswith("Qwen3VL"):
            from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
            if cap:
                per_frame = max(min(p.max_video_tokens * factor * factor, hi // frames), int(lo * 1.05))
                hi = per_frame * frames
            return smart_resize(num_frames=frames, height=height, width=width,  # (fewer than 2 frames: it refuses)
                                temporal_factor=self.temporal, factor=factor, min_pixels=lo, max_pixels=hi)
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize
        if cap:
            total = int(p.max_video_tokens * factor * factor * 0.9)
            hi = max(min(hi, total * self.temporal // frames), int(lo * 1.05))
        return smart_resize(height, width, factor=factor, min_pixels=lo, max_pixels=hi)

    def tokens(self, plan: VideoPlan) -> int:
        t, h, w = plan.grid
        return t * h * w // (self.merge * self.merge)

    def token_ids(self, plan: VideoPlan, ids: dict, tokenize) -> list:
        """The video's token ids in the text: ``ids`` the vision tokens' (``start``, ``end``, ``pad``),
        ``tokenize(text)`` the tokenizer's ids of a text piece."""
        t, h, w = plan.grid
        if self.style == "qwen2":
            return [ids["start"]] + [ids["pad"]] * (t * h * w // self.merge ** 2) + [ids["end"]]
        out, per_frame = [ids["start"]], h * w // self.merge ** 2
        for seconds in plan.timestamps:
            out += tokenize(f"<{seconds:.1f} seconds>") + [ids["start"]] + [ids["pad"]] * per_frame + [ids["end"]]
        return out + [ids["end"]]

    # ---- decoding ----------------------------------------------------------------------------------------
    def load(self, source: str, plan: Optional[VideoPlan] = None):
        """(visual items, None) or (None, why): the planned frames decoded and processed. Items are
        ``(patches, grid)`` (Qwen3: one per temporal patch) or ``(patches, grid, time_interval)`` (Qwen2.5-VL)."""
        try:
            plan = plan or self.plan(source)
            frames = self._frames(source, plan)
        except Exception as e:  # noqa: BLE001 - a corrupt or missing file is the sample's error
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return None, f"cannot decode video ({type(e).__name__}: {first})"
        return self.items(frames, plan), None

    def _frames(self, source: str, plan: VideoPlan) -> np.ndarray:
        if is_frames(source):
            from PIL import Image
            files = frame_files(source)
            return np.stack([np.asarray(Image.open(files[i]).convert("RGB")) for i in plan.indices])
        from transformers.video_utils import load_video
        frames, _ = load_video(source, backend="pyav", sample_indices_fn=lambda metadata, **kw: np.asarray(plan.indices))
        if len(frames) != len(plan.indices):
            raise ValueError(f"{len(frames)} frames decoded of the {len(plan.indices)} sampled (a truncated file?)")
        return frames

    def process(self, frames: np.ndarray, plan: VideoPlan) -> tuple:
        """(patches (n, 3*T*P*P) float, grid (3,) int64): the processor on the sampled frames."""
        from transformers.video_utils import VideoMetadata
        meta = VideoMetadata(total_num_frames=len(frames), fps=plan.fps, frames_indices=np.asarray(plan.indices))
        out = self.processor(videos=[frames], video_metadata=[meta], do_sample_frames=False, return_tensors="pt")
        grid = out["video_grid_thw"][0].to(torch.int64)
        if tuple(grid.tolist()) != tuple(plan.grid):
            raise ValueError(f"the processor made a {tuple(grid.tolist())} grid of the frames, the plan {plan.grid}")
        return out["pixel_values_videos"].float(), grid

    def items(self, frames: np.ndarray, plan: VideoPlan) -> list:
        patches, grid = self.process(frames, plan)
        if self.style == "qwen2":
            second_per_grid_t = torch.tensor(self.temporal / plan.sampled_fps, dtype=torch.float32)
            return [(patches, grid, float(second_per_grid_t * self.tokens_per_second))]
        t, h, w = (int(v) for v in grid)
        one = torch.tensor([1, h, w], dtype=torch.int64)
        return [(chunk, one.clone()) for chunk in patches.split(h * w)]

    def second_per_grid_t(self, plan: VideoPlan) -> float:
        return self.temporal / plan.sampled_fps

    def model_inputs(self, sources: list) -> dict:
        """transformers' video inputs of ``sources`` (generation): ``pixel_values_videos``, ``video_grid_thw`` (one
        ``(T, h, w)`` row a video) and, for Qwen2.5-VL, ``second_per_grid_ts``; a video that cannot be read raises
        ``ValueError`` naming why."""
        patches, grids, seconds = [], [], []
        for source in sources:
            try:
                plan = self.plan(source)
                p, g = self.process(self._frames(source, plan), plan)
            except Exception as e:  # noqa: BLE001
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise ValueError(f"cannot decode video ({type(e).__name__}: {first})") from None
            patches.append(p)
            grids.append(g)
            seconds.append(self.second_per_grid_t(plan))
        out = {"pixel_values_videos": torch.cat(patches), "video_grid_thw": torch.stack(grids)}
        if self.style == "qwen2":
            out["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
        return out


def video_processor(pretrained: Optional[str], style: str, defaults: dict, data_cfg=None):
    """The directory's video processor (``model.pretrained``), else transformers' (Qwen2-VL's or Qwen3-VL's) with
    ``defaults``; the run's ``data.video_*`` settings override its sampling and pixel bounds."""
    import transformers
    proc = None
    if pretrained:
        try:
            proc = transformers.AutoVideoProcessor.from_pretrained(pretrained, local_files_only=True)
        except (OSError, ValueError, KeyError):  # a directory saved before video processors had their own config:
            image = transformers.AutoImageProcessor.from_pretrained(pretrained, local_files_only=True)
            defaults = {k: getattr(image, k) for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean",
                                                      "image_std") if getattr(image, k, None) is not None}
    if proc is None:  # transformers' class at the image processor's geometry (an image-only run never fails here)
        cls = transformers.Qwen3VLVideoProcessor if style == "qwen3" else transformers.Qwen2VLVideoProcessor
        proc = cls(**{k: v for k, v in defaults.items() if k in ("patch_size", "temporal_patch_size", "merge_size",
                                                                  "image_mean", "image_std")})
    if getattr(proc, "cap_pixels_per_frame", None) is None:
        proc.cap_pixels_per_frame = False  # (transformers' behaviour when unset, said once instead of warned)
    get = (lambda k: getattr(data_cfg, k, None)) if data_cfg is not None else (lambda k: None)
    if get("video_fps"):
        proc.fps = float(get("video_fps"))
    for key, attr in (("video_min_frames", "min_frames"), ("video_max_frames", "max_frames")):
        if get(key):
            setattr(proc, attr, int(get(key)))
    if get("video_min_pixels") or get("video_max_pixels"):
        size = dict(proc.size)
        size["shortest_edge"] = int(get("video_min_pixels") or size["shortest_edge"])
        size["longest_edge"] = int(get("video_max_pixels") or size["longest_edge"])
        proc.size = size
    if proc.fps is None or not math.isfinite(float(proc.fps)):
        proc.fps = 2.0
    check_budgets(int(proc.min_frames), int(proc.max_frames), int(proc.size["shortest_edge"]),
                  int(proc.size["longest_edge"]))
    return proc


def check_budgets(min_frames, max_frames, min_pixels, max_pixels) -> None:
    """One line for a frame or pixel budget whose minimum is above its maximum (the processor would sample past
    the frame budget, or grow a small video past the pixel budget); unset ones (None) are not checked."""
    for what, lo, hi in (("frames", min_frames, max_frames), ("pixels", min_pixels, max_pixels)):
        if lo is not None and hi is not None and lo > hi:
            raise ConfigError(f"data.video_min_{what}={lo} is above data.video_max_{what}={hi} (the video processor's "
                              f"where one is unset): give video_min_{what} <= video_max_{what}")


class VideoInput:
    """A family's video input as the chat encoder and loader use it: ``video_ids(source)`` (the token ids, from the
    header), ``load(source)`` (the visual items), ``plan(source)``, ``pad_id``. Picklable (loader workers)."""

    PLANS = 4096  # headers remembered (encoding a sample and then loading it read its header once)

    def __init__(self, native: NativeVideo, tokenizer, start: int, end: int, pad: int):
        self.native, self.tok = native, tokenizer
        self.ids = {"start": start, "end": end, "pad": pad}
        self.pad_id = pad
        self._plans: dict = {}

    def _tokenize(self, text: str) -> list:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def plan(self, source) -> VideoPlan:
        key = tuple(source) if isinstance(source, list) else source
        if key not in self._plans:
            if len(self._plans) >= self.PLANS:
                self._plans.pop(next(iter(self._plans)))  # the oldest
            self._plans[key] = self.native.plan(source)
        return self._plans[key]

    def video_ids(self, source) -> list:
        return self.native.token_ids(self.plan(source), self.ids, self._tokenize)

    def load(self, source):
        try:
            plan = self.plan(source)
        except Exception:  # noqa: BLE001 - the native load names why
            plan = None
        return self.native.load(source, plan)
