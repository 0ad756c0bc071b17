"""``parallel.micro_batch_size: auto``: the largest micro-batch whose measured peak memory fits the
budget on every stage, probed with real batches (``auto_micro_batch``), and the config checks it needs."""
from __future__ import annotations

from typing import Callable, Optional

from mmpipe.config.deepspeed import AUTO, load_json
from mmpipe.config.schema import RunConfig, replace
from mmpipe.data.shards import iter_tar
from mmpipe.errors import ConfigError, DataError
from mmpipe.parallel.schedules import Order, candidates, default_order
from mmpipe.planning.measure import _with_schedule, iter_layers, precision_dtype
from mmpipe.planning.memory import pick_micro_batch, run_shape, stage_memory
from mmpipe.planning.profiler import profile_layers


def probe_batch(cfg, family, source, tok, m: int, device) -> tuple:
    """A real micro-batch of ``m`` samples from the training source (the family's first-stage
    fields), captions padded to ``data.max_length`` (the largest shape a run can meet)."""
    collate = family.collate(tok, replace(cfg, data__padding="max_length").data)
    if source.kind == "shards":
        import io

        items, pixels = [], family.pixels(cfg.model, cfg.data)
        for _, image, text in iter_tar(source.shard_urls[0]):
            px, _ = pixels.load(io.BytesIO(image), text or "", 0, 0) if image else (None, None)
            if px is not None:
                items.append({"pixel_values": px, "text": text, "index": -1, "bad": []})
        if not items:
            raise DataError(f"no usable sample in {source.shard_urls[0]}")
        items = [items[i % len(items)] for i in range(m)]
    else:
        ds = source.dataset(cfg, family=family, tok=tok)
        items = [ds[i % len(ds)] for i in range(m)]
    b = collate(items)
    return tuple(b[f].to(device) for f in family.inputs)


def possible_orders(requested: str, P: int) -> list:
    """The orders a run of ``P`` stages asking for ``requested`` may take (before its cut is known)."""
    if P == 1:
        return [default_order()]
    return candidates(P, 0) if requested == "auto" else [Order(requested)]


def auto_micro_batch(cfg, family, source, tok, pipeline_stages: int, data_parallel: int,
                     parts: Optional[list], forward_only: frozenset, frozen_params: frozenset, budget_bytes: int,
                     device, log: Optional[Callable[[str], None]] = None) -> tuple[int, dict]:
    """(micro-batch size, {probed size: peak bytes of the fullest stage})."""
    dtype = precision_dtype(cfg.train.precision)
    if parts is None:  # not placed yet: costed as one stage per P-th of the layers
        n = len(family.layer_names())
        parts = [round(i * n / pipeline_stages) for i in range(pipeline_stages + 1)]
    per_rank = cfg.train.batch_size // data_parallel

    def peak(m: int) -> int:
        layers = iter_layers(family, forward_only, frozen_params, device, dtype)  # one layer alive at a time
        costs = profile_layers(layers, probe_batch(cfg, family, source, tok, m, device), timed=False)
        micro_batches = per_rank // m
        # what the run does beyond forward and backward (checkpointing, ties, the step's batches, a
        # step loss's feature cache), as the layout model reads it from a profile
        # (the order is chosen with the cut, after: the size must fit under every order the run may take)
        prof = _with_schedule({"key": {"micro_batch_size": m, "forward_only": sorted(forward_only),
                                       "precision": cfg.train.precision}, "layers": [c.to_dict() for c in costs]},
                              family, cfg)
        return max(max(stage_memory(costs, parts, micro_batches, cfg.train.precision, cfg.parallel.zero_stage,
                                    data_parallel, run_shape(prof, order)))
                   for order in possible_orders(cfg.parallel.schedule, pipeline_stages))

    return pick_micro_batch(per_rank, peak, budget_bytes, log, min_size=family.min_micro_batch)


def check_auto_micro_batch(cfg: RunConfig) -> None:
    if cfg.train.deepspeed_config:
        v = load_json(cfg.train.deepspeed_config).get("train_micro_batch_size_per_gpu", AUTO)
        if v != AUTO:
            raise ConfigError(f"{cfg.train.deepspeed_config}: train_micro_batch_size_per_gpu={v} disagrees with "
                              "parallel.micro_batch_size=auto; write \"auto\" in the JSON or give a size")


