"""Which training data source a run reads, and the loader built on it.

Three sources share one batch contract (uint8 images, padded ids + mask, sample keys, bad list):
- a manifest (``data.train: x.jsonl|x.csv``): decoded on the fly (``ImageTextDataset``);
- a preprocessed cache (``data.cache: DIR`` from ``mmpipe data prepare``): ``CachedDataset``;
- WebDataset tar shards (``data.train: "dir/{00000..00099}.tar"``): ``ShardStream``.
Manifest and cache are indexable and go through ``MicroBatchSampler`` (the same micro-batches in
every layout, exact resume); shards stream, split by data-parallel rank and loader worker.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from mmpipe.data.balance import SampleUnits, StepBalancer
from mmpipe.data.cache import (
    CachedDataset,
    check_compatible,
    open_meta,
    tokenizer_digest,
)
from mmpipe.data.handoff import Packed, Unpacking
from mmpipe.data.loader import make_loader
from mmpipe.data.manifest import require_manifest
from mmpipe.data.sampler import MicroBatchSampler
from mmpipe.data.shards import ShardStream, expand, is_shard_spec, iter_tar
from mmpipe.data.tokenizer import has_tokenizer, load_tokenizer
from mmpipe.errors import ConfigError


@dataclass
class TrainSource:
    kind: str  # manifest | cache | shards
    samples: Optional[list] = None  # manifest rows
    cache_meta: Optional[dict] = None
    shard_urls: Optional[list] = None

    @property
    def size(self) -> Optional[int]:
        """Number of training rows, or None for a stream (the bad fraction then counts drawn samples)."""
        if self.kind == "manifest":
            return len(self.samples)
        if self.kind == "cache":
            return self.cache_meta["n"]
        return None

    def dataset(self, cfg, seed=None, *, family, tok=None):
        """The indexable dataset of a manifest (the family's records) or cache source; ``seed``:
        training data (its augmentation draws), None: no augmentation."""
        if self.kind == "cache":
            return CachedDataset(cfg.data.cache, family.pixels(cfg.model, cfg.data, seed))
        if self.kind == "manifest":
            return family.dataset(self.samples, tok, cfg.data, seed)
        raise TypeError("shards are a stream, not an indexable dataset")

    def captions(self, limit: int = 100_000, *, family) -> list[str]:
        """Texts to train a tokenizer on (a manifest's: the family's ``record_texts``)."""
        if self.kind == "manifest":
            return family.record_texts(self.samples)
        out = []
        for url in self.shard_urls:
            out.extend(t for _, _, t in iter_tar(url) if t)
            if len(out) >= limit:
                break
        return out[:limit]


def open_source(cfg, read: bool, *, family) -> TrainSource:
    """Check the configured source exists (every rank: the same one-line error everywhere) and, with
    ``read``, load what the data-reading rank needs (``family.read_records``: its record format)."""
    d = cfg.data
    family.check_source("cache" if d.cache else "shards" if d.train and is_shard_spec(d.train) else "manifest")
    pixels = family.pixels(cfg.model, d)  # the family's image input (reads its image config: fails here first)
    if d.cache:
        meta = open_meta(d.cache)
        check_compatible(meta, d.cache, pixels.cache_size, d.max_length, d.train)
        return TrainSource("cache", cache_meta=meta)
    if is_shard_spec(d.train):
        return TrainSource("shards", shard_urls=expand(d.train))
    if not read:
        require_manifest(d.train, "data.train")
        return TrainSource("manifest", samples=[])
    return TrainSource("manifest", samples=family.read_records(d.train, d, "data.train"))


def tokenizer_dir(cfg) -> Optional[str]:
    """A tokenizer fixed by the data: the cache's (its ids were made with it)."""
    if cfg.data.cache:
        return os.path.join(cfg.data.cache, "tokenizer")
    return None


def check_cache_tokenizer(cfg, tok) -> None:
    if cfg.data.cache and cfg.data.tokenizer:
        if tokenizer_digest(tok) != open_meta(cfg.data.cache)["tokenizer_sha1"]:
            raise ConfigError(f"data.tokenizer={cfg.data.tokenizer} is not the tokenizer data.cache={cfg.data.cache} "
                              "was built with; unset data.tokenizer (the cache's is used) or re-run prepare with it")


def check_cache_tokenizer_fits_weights(cache: str, weights_key: str, weights_dir: str) -> None:
    """A cache's token ids were made with its tokenizer: with pretrained text weights it must be theirs."""
    meta = open_meta(cache)
    fix = "rebuild it with mmpipe data prepare --tokenizer DIR, DIR being the tokenizer the weights were trained with"
    if meta.get("tokenizer") is None:
        raise ConfigError(f"data.cache={cache} holds ids of a tokenizer trained on the captions, which the pretrained "
                          f"text weights in {weights_key}={weights_dir} never saw; {fix}")
    if has_tokenizer(weights_dir) and \
            tokenizer_digest(load_tokenizer(weights_dir, weights_key)) != meta["tokenizer_sha1"]:
        raise ConfigError(f"data.cache={cache} was built with a tokenizer other than the one in "
                          f"{weights_key}={weights_dir}; {fix}")


def train_lengths(source: TrainSource, tok, max_length: int) -> list[int]:
    """Caption token counts per manifest row (for length grouping; the cache stores its own)."""
    enc = tok([s.text for s in source.samples], truncation=True, max_length=max_length)["input_ids"]
    return [len(x) for x in enc]


def sample_units(dataset, source: TrainSource, tok, max_length: int):
    """``data.balance: cost``'s per-item ``SampleUnits``: the dataset's own (chat data: image tokens and
    tokens), else one image per item and its caption's tokens."""
    import numpy as np

    if hasattr(dataset, "units"):
        return dataset.units
    lengths = dataset.lengths if hasattr(dataset, "lengths") else train_lengths(source, tok, max_length)
    return SampleUnits(np.ones(len(lengths)), lengths)


def build_train_loader(cfg, source: TrainSource, tok, collate, topo, dp_rank: int, start_step: int,
                       device_is_cpu: bool, family, start_at: Optional[dict] = None, prices=None):
    """The training loader from global step ``start_step``; ``start_at``: the stream position a
    checkpoint saved (``MicroBatchSampler.position``), so a resume with another batch size continues
    at the next unseen sample. The loader's ``batch_sampler`` (indexable sources) tells positions.
    ``prices`` (``data.balance: cost``): the plan's ``StagePrices``, with which every step is regrouped."""
    from torch.utils.data import DataLoader

    d = cfg.data
    if source.kind == "shards" and d.balance == "cost":
        raise ConfigError(f"data.balance=cost regroups each step's samples by their cost, and data.train={d.train} is "
                          "a stream of shards (read in order, never indexed): use a manifest or data.cache, or "
                          "data.balance=none")
    if source.kind == "shards":
        stream = ShardStream(source.shard_urls, topo.data_parallel, dp_rank, d.num_workers, topo.micro_batch_size,
                             Packed(collate) if d.num_workers else collate,
                             family.pixels(cfg.model, d, cfg.train.seed), cfg.train.seed, start_step,
                             d.shuffle_buffer, d.group_by_length, d.group_window)
        if not d.num_workers:
            return DataLoader(stream, batch_size=None, num_workers=0, pin_memory=d.pin_memory and not device_is_cpu)
        return Unpacking(DataLoader(stream, batch_size=None, num_workers=stream.workers,
                                    pin_memory=d.pin_memory and not device_is_cpu, prefetch_factor=d.prefetch_factor,
                                    persistent_workers=d.persistent_workers))
    dataset = source.dataset(cfg, cfg.train.seed, family=family, tok=tok)
    lengths = None
    if d.group_by_length:  # the cache and chat data count their tokens; a manifest's are counted here
        lengths = dataset.lengths if hasattr(dataset, "lengths") else train_lengths(source, tok, d.max_length)
    balancer = None
    if d.balance == "cost" and prices is not None:
        # a family whose shapes change per micro-batch anyway takes micro-batches of any size (few long
        # rows or many short ones: even slots without padding); fixed shapes keep the micro-batch size
        balancer = StepBalancer(sample_units(dataset, source, tok, d.max_length), prices, topo.data_parallel,
                                variable=family.dynamic_shapes and d.padding != "max_length",
                                evenness=d.balance_evenness,
                                micro_batch_sync=topo.pipeline_stages == 1 and cfg.parallel.zero_stage >= 2)
        if d.num_workers:  # the data path has processes of its own: regroup each next step in one more
            balancer.start_ahead()
    sampler = MicroBatchSampler(len(dataset), topo.micro_batch_size, topo.accumulation_steps, topo.data_parallel,
                                dp_rank, cfg.train.seed, start_step=start_step, max_steps=cfg.train.steps,
                                lengths=lengths, group_window=d.group_window, start_at=start_at, balancer=balancer)
    return make_loader(dataset, sampler, collate, d, device_is_cpu)
