"""Preprocessed cache: ``mmpipe data prepare --manifest M --out DIR``.

Layout of DIR (all plain numpy files, memory-mapped when training):
- ``images.u8``   uint8 (N, 3, S, S): each manifest row decoded by ``load_image`` at size S
- ``tokens.npy``  int32 (N, L): token ids (with the tokenizer's special tokens), truncated to L
- ``lengths.npy`` int16 (N,): ids per row
- ``status.u8``   uint8 (N,): 0 = not done yet, 1 = ok, 2 = unusable (reason in ``bad.jsonl``)
- ``bad.jsonl``   {"index", "path", "why"} per unusable row (``path``: ``FILE line N`` for a bad manifest row)
- ``meta.json``   manifest fingerprint, S, L, tokenizer, ``complete``
- ``tokenizer/``  the tokenizer the ids were made with

Rows stay aligned with the manifest (unusable ones included, flagged), so a cached run draws the
same micro-batches, substitutes unusable samples the same way and reports the same file names as
a run that decodes the manifest. ``prepare`` is resumable: rows whose status is set are not
redone, so an interrupted (or ``--max-items``-limited) run continues where it stopped.
Augmentation is not cached: it runs after the cache, per epoch.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import numpy as np
import torch

from mmpipe.data.decode import decode_sample
from mmpipe.data.json_files import write_json

from mmpipe.data.loader import SubstitutingDataset
from mmpipe.data.manifest import read_manifest
from mmpipe.data.processes import pool_context
from mmpipe.data.tokenizer import load_tokenizer, train_tokenizer
from mmpipe.errors import ConfigError

VERSION = 1
TODO, OK, BAD = 0, 1, 2


def _sha1_file(path: str) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_digest(tok) -> str:
    vocab = sorted(tok.get_vocab().items())
    return hashlib.sha1(json.dumps([vocab, tok.__class__.__name__]).encode()).hexdigest()


# ---- worker side (one process per loader worker of the pool) ------------------------------------
_W: dict = {}


def _init_worker(images_path: str, n: int, size: int) -> None:
    torch.set_num_threads(1)
    _W["images"] = np.memmap(images_path, dtype=np.uint8, mode="r+", shape=(n, 3, size, size))
    _W["size"] = size


def _work(chunk: list) -> list:
    out = []
    for idx, path, text in chunk:
        pixels, why = decode_sample(path, text, _W["size"])
        if pixels is not None:
            _W["images"][idx] = pixels.numpy()
        out.append((idx, why))
    return out


# ---- prepare -----------------------------------------------------------------------------------
def _open_or_start(out: str, samples: list, fingerprint: dict, tokenizer: Optional[str], vocab_size: int) -> dict:
    """The cache's meta: read back when the build is continued (it must be the same build), else
    the build started: tokenizer, token ids and lengths written, image and status files allocated."""
    n, size, max_length = fingerprint["n"], fingerprint["size"], fingerprint["max_length"]
    meta_path = os.path.join(out, "meta.json")
    tok_dir = os.path.join(out, "tokenizer")
    if os.path.isfile(meta_path):
        with open(meta_path) as fh:
            meta = json.load(fh)
        differs = [k for k, v in fingerprint.items() if k != "manifest" and meta.get(k) != v]
        if differs:
            raise ConfigError(f"{out} holds a cache of another build ({', '.join(f'{k}={meta.get(k)}' for k in differs)}"
                              f"); use a new --out, or delete {out} to rebuild")
        tok = load_tokenizer(tok_dir, f"{out}/tokenizer")
    else:
        if tokenizer:
            tok = load_tokenizer(tokenizer, "--tokenizer")
            tok.save_pretrained(tok_dir)
        else:
            tok = train_tokenizer([s.text for s in samples], vocab_size, tok_dir)
        enc = tok([s.text for s in samples], truncation=True, max_length=max_length)["input_ids"]
        tokens = np.full((n, max_length), tok.pad_token_id or 0, dtype=np.int32)
        lengths = np.zeros(n, dtype=np.int16)
        for i, ids in enumerate(enc):
            tokens[i, :len(ids)] = ids
            lengths[i] = len(ids)
        np.save(os.path.join(out, "tokens.npy"), tokens)
        np.save(os.path.join(out, "lengths.npy"), lengths)
        np.memmap(os.path.join(out, "images.u8"), dtype=np.uint8, mode="w+", shape=(n, 3, size, size)).flush()
        np.memmap(os.path.join(out, "status.u8"), dtype=np.uint8, mode="w+", shape=(n,)).flush()
        open(os.path.join(out, "bad.jsonl"), "w").close()
        meta = {**fingerprint, "tokenizer": tokenizer, "tokenizer_sha1": tokenizer_digest(tok), "complete": False}
        write_json(meta_path, meta, indent=2)
    return meta


def prepare(manifest: str, out: str, size: int, max_length: int, tokenizer: Optional[str] = None,
            vocab_size: int = 2000, workers: int = 2, chunk: int = 32, max_items: Optional[int] = None,
            progress: bool = True) -> dict:
    """Build (or continue building) the cache. Returns counts: done now, ok, bad, remaining."""

    from tqdm import tqdm


    samples = read_manifest(manifest, "--manifest")
    n = len(samples)
    os.makedirs(out, exist_ok=True)
    meta_path = os.path.join(out, "meta.json")
    fingerprint = {"version": VERSION, "manifest": os.path.abspath(manifest), "manifest_sha1": _sha1_file(manifest),
                   "n": n, "size": size, "max_length": max_length}
    meta = _open_or_start(out, samples, fingerprint, tokenizer, vocab_size)
    status = np.memmap(os.path.join(out, "status.u8"), dtype=np.uint8, mode="r+", shape=(n,))
    todo = np.flatnonzero(status == TODO)
    if max_items is not None:
        todo = todo[:max_items]
    bad_rows = [int(i) for i in todo if samples[i].error is not None]  # unusable manifest rows: nothing to decode
    todo = [int(i) for i in todo if samples[i].error is None]
    chunks = [[(i, samples[i].image, samples[i].text) for i in todo[k:k + chunk]]
              for k in range(0, len(todo), chunk)]
    done_now = 0
    bar = tqdm(total=n, initial=n - int((status == TODO).sum()), unit="img", desc=f"prepare {out}",
               disable=not progress, mininterval=1.0)
    ctx = pool_context("mmpipe.data.cache")  # (not a plain fork: see mmpipe.data.processes)
    with open(os.path.join(out, "bad.jsonl"), "a") as bad_fh, \
            ctx.Pool(max(1, workers), _init_worker, (os.path.join(out, "images.u8"), n, size)) as pool:
        for idx in bad_rows:  # named "FILE line N", as the decoding path names them
            bad_fh.write(json.dumps({"index": idx, "path": samples[idx].where, "why": samples[idx].error}) + "\n")
            status[idx] = BAD
        bad_fh.flush()
        done_now += len(bad_rows)
        bar.update(len(bad_rows))
        for results in pool.imap(_work, chunks):
            for idx, why in results:
                if why is not None:
                    bad_fh.write(json.dumps({"index": idx, "path": samples[idx].image, "why": why}) + "\n")
                status[idx] = BAD if why is not None else OK  # after the image row is written
            bad_fh.flush()
            done_now += len(results)
            bar.update(len(results))
    bar.close()
    status.flush()
    remaining = int((status == TODO).sum())
    meta["complete"] = remaining == 0
    write_json(meta_path, meta, indent=2)
    return {"done_now": done_now, "ok": int((status == OK).sum()), "bad": int((status == BAD).sum()),
            "remaining": remaining}



# ---- read --------------------------------------------------------------------------------------
def open_meta(cache_dir: str) -> dict:
    path = os.path.join(cache_dir, "meta.json")
    if not os.path.isfile(path):
        raise ConfigError(f"data.cache: no cache at {cache_dir} (build it with: mmpipe data prepare --manifest "
                          f"TRAIN.jsonl --out {cache_dir})")
    with open(path) as fh:
        meta = json.load(fh)
    if not meta.get("complete"):
        raise ConfigError(f"data.cache: {cache_dir} is incomplete (prepare was interrupted); re-run the same "
                          "`mmpipe data prepare` command to finish it")
    return meta


def check_compatible(meta: dict, cache_dir: str, decode_size: int, max_length: int, train: Optional[str]) -> None:
    if meta["size"] != decode_size:
        raise ConfigError(f"data.cache: {cache_dir} holds {meta['size']}px images but the run decodes at {decode_size}px "
                          f"(data.decode_size or the model's image size); set data.decode_size={meta['size']} or "
                          f"re-run prepare with --size {decode_size}")
    if meta["max_length"] != max_length:
        raise ConfigError(f"data.cache: {cache_dir} was tokenized with max_length {meta['max_length']} but "
                          f"data.max_length={max_length}; set data.max_length={meta['max_length']} or re-run prepare "
                          f"with --max-length {max_length}")
    if train and os.path.isfile(train) and _sha1_file(train) != meta["manifest_sha1"]:
        raise ConfigError(f"data.cache: {cache_dir} was built from another manifest than data.train={train}; "
                          "re-run prepare on it, or unset data.train")


class CachedDataset(SubstitutingDataset):
    """The cache as a dataset with ``ImageTextDataset``'s item contract (``ids`` instead of ``text``)."""

    def __init__(self, cache_dir: str, pixels):
        self.dir = cache_dir
        self.what = f"the cache {cache_dir}"
        with open(os.path.join(cache_dir, "meta.json")) as fh:
            self.meta = json.load(fh)
        self.n, self.size = self.meta["n"], self.meta["size"]
        self.pixels = pixels  # the family's image input: finishes each cached image
        self.tokens = np.load(os.path.join(cache_dir, "tokens.npy"), mmap_mode="r")
        self.lengths = np.load(os.path.join(cache_dir, "lengths.npy"))
        self.status = np.fromfile(os.path.join(cache_dir, "status.u8"), dtype=np.uint8)
        self.bad_why = {}
        with open(os.path.join(cache_dir, "bad.jsonl")) as fh:
            for line in fh:
                r = json.loads(line)
                self.bad_why[r["index"]] = (r["path"], r["why"])
        self._images = None  # opened lazily: each loader worker maps the file itself

    @property
    def images(self) -> np.memmap:
        if self._images is None:
            self._images = np.memmap(os.path.join(self.dir, "images.u8"), dtype=np.uint8, mode="r",
                                     shape=(self.n, 3, self.size, self.size))
        return self._images

    def __getstate__(self):
        return {**self.__dict__, "_images": None}

    def __len__(self):
        return self.n

    def _load(self, j: int):
        if self.status[j] != OK:
            return None, self.bad_why.get(j, (f"{self.dir}[{j}]", "not in cache"))
        return {"pixel_values": torch.from_numpy(np.array(self.images[j])),
                "ids": self.tokens[j, :self.lengths[j]]}, None
