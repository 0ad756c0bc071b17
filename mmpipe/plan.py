"""Sizing and planning from measured layer costs (``mmpipe.profile``) on real batches.

- ``auto_micro_batch``: ``parallel.micro_batch_size: auto`` - the largest micro-batch (a divisor of
  the per-rank batch, so the global batch stays exact) whose peak memory on every stage fits
  ``parallel.memory_budget_gb``; accumulation steps follow from the batch equation.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from mmpipe.profile import pick_micro_batch, profile_layers, stage_memory


def build_layers(spec, forward_only: frozenset = frozenset(), frozen_params: frozenset = frozenset(),
                 device: Optional[torch.device] = None, dtype: torch.dtype = torch.float32) -> list:
    """Every pipeline layer of the model, in one process (seeded per part: the pipeline's weights)."""
    from mmpipe.pipeline.layers import PipeLayer, plain_state_key
    layers = []
    for name in spec.part_names():
        layer = PipeLayer(spec, name, name in forward_only).to(device=device, dtype=dtype)
        for k, p in layer.named_parameters():
            if plain_state_key(name, k) in frozen_params:
                p.requires_grad_(False)
        layers.append(layer.train())
    return layers


def probe_batch(cfg, source, tok, m: int, image_size: int, device) -> tuple:
    """A real micro-batch of ``m`` samples from the training source, captions padded to
    ``data.max_length`` (the largest shape a run can meet)."""
    from mmpipe.data.loader import Collate, ImageTextDataset
    collate = Collate(tok, cfg.data.max_length, "max_length")
    size = cfg.data.decode_size or image_size
    if source.kind == "cache":
        from mmpipe.data.cache import CachedDataset
        ds = CachedDataset(cfg.data.cache, image_size)
        items = [ds[i % len(ds)] for i in range(m)]
    elif source.kind == "manifest":
        ds = ImageTextDataset(source.samples, image_size, decode_size=size)
        items = [ds[i % len(ds)] for i in range(m)]
    else:
        import io

        from mmpipe.data.loader import decode_sample
        from mmpipe.data.shards import iter_tar
        items = []
        while len(items) < m:
            for _, image, text in iter_tar(source.shard_urls[0]):
                px, _ = decode_sample(io.BytesIO(image or b""), text or "", image_size) if image else (None, None)
                if px is not None:
                    items.append({"pixel_values": px, "text": text, "index": -1, "bad": []})
                if len(items) == m:
                    break
            if not items:
                raise RuntimeError(f"no usable sample in {source.shard_urls[0]}")
    b = collate(items)
    return tuple(t.to(device) for t in (b["pixel_values"], b["input_ids"], b["attention_mask"]))


def auto_micro_batch(cfg, spec, source, tok, image_size: int, pipeline_stages: int, data_parallel: int,
                     parts: Optional[list], forward_only: frozenset, frozen_params: frozenset, budget_bytes: int,
                     device, log: Optional[Callable[[str], None]] = None) -> tuple[int, dict]:
    """(micro-batch size, {probed size: peak bytes of the fullest stage})."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision, torch.float32)
    layers = build_layers(spec, forward_only, frozen_params, device, dtype)
    if parts is None:  # DeepSpeed partitions (uniform/parameters/type:): costed as one stage per P-th
        n = len(layers)
        parts = [round(i * n / pipeline_stages) for i in range(pipeline_stages + 1)]
    per_rank = cfg.train.batch_size // data_parallel

    def peak(m: int) -> int:
        costs = profile_layers(layers, probe_batch(cfg, source, tok, m, image_size, device), timed=False)
        micro_batches = per_rank // m
        return max(stage_memory(costs, parts, micro_batches, cfg.train.precision, cfg.parallel.zero_stage,
                                data_parallel))

    return pick_micro_batch(per_rank, peak, budget_bytes, log)
