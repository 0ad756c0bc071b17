"""One rank of ``open_clip_train`` for ``mmpipe bench peers --family clip``, run under torchrun:
open_clip's own ``main`` (its data loader, DDP, loss with ``--gather-with-grad``, optimizer and
schedule), given mmpipe's tokenizer and image preprocessing so that both systems train on the same
token ids and pixels. On a CPU, open_clip wraps the model as ``DistributedDataParallel(model,
device_ids=[device])``, which torch refuses for a CPU module: the wrapper drops ``device_ids`` there.

    python -m torch.distributed.run --nproc_per_node 2 -m mmpipe.bench.open_clip_worker SPEC.json

``SPEC.json``: ``args`` (open_clip_train's command line), ``model_config_dir`` (the open_clip model
config), ``tokenizer`` (an mmpipe tokenizer directory), ``max_length``, ``image_size``, ``mean``,
``std``, ``threads``. The spec is a file because torchrun would take ``--logs`` after the module
name for its own ``--logs-specs``."""
from __future__ import annotations

import json
import sys

import torch

from mmpipe.data.decode import load_image
from mmpipe.data.tokenizer import load_tokenizer
from mmpipe.families.towers.common import normalize_pixels


def open_clip_tokenizer(tokenizer, max_length: int):
    """open_clip's tokenizer interface (texts -> LongTensor (N, max_length)) over an mmpipe tokenizer:
    the same ids mmpipe's collate gives, padded to ``max_length``."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def tokenize(texts, context_length=None):
        ids = tokenizer([str(t) for t in texts], truncation=True, max_length=max_length)["input_ids"]
        out = torch.full((len(ids), max_length), pad, dtype=torch.long)
        for i, x in enumerate(ids):
            out[i, :len(x)] = torch.as_tensor(x, dtype=torch.long)
        return out
    return tokenize


def mmpipe_preprocess(size: int, mean, std):
    """A PIL image that open_clip opened -> mmpipe's pixels for it (its decode, centre square and
    antialiased resize, then the tower's normalisation), as a float (3, size, size) tensor."""
    def preprocess(image):
        return normalize_pixels(load_image(image.filename, size)[None], mean, std, torch.float32)[0]
    return preprocess


def _cpu_ready_ddp() -> None:
    ddp = torch.nn.parallel.DistributedDataParallel

    class DDP(ddp):
        def __init__(self, module, device_ids=None, **kw):
            on_cpu = next(module.parameters()).device.type == "cpu"
            super().__init__(module, device_ids=None if on_cpu else device_ids, **kw)
    torch.nn.parallel.DistributedDataParallel = DDP


def synthetic_tokenizer(config_dir: str):
    """``mmpipe bench gpu``'s open_clip run on its synthetic data: every caption the same full-length
    row of ids inside the model's vocabulary, its EOS last (open_clip's own BPE tokenizer would give
    ids past a small test vocabulary)."""
    import glob
    with open(glob.glob(f"{config_dir}/*.json")[0]) as fh:
        text = json.load(fh)["text_cfg"]
    n, vocab, eos = text["context_length"], text["vocab_size"], text.get("eos_id", text["vocab_size"] - 1)
    row = torch.arange(n, dtype=torch.long) % max(1, min(vocab, eos) - 1) + 1
    row[-1] = eos

    def tokenize(texts, context_length=None):
        return row.repeat(len(texts) if isinstance(texts, (list, tuple)) else 1, 1)
    return tokenize


def _report_peak() -> None:
    if torch.cuda.is_available():
        print(f"PEAK_MB {torch.cuda.max_memory_allocated() / 2**20:.0f}", flush=True)


def main(spec_path: str) -> int:
    with open(spec_path) as fh:
        spec = json.load(fh)
    torch.set_num_threads(spec["threads"])
    import open_clip
    import open_clip_train.main as oc
    open_clip.add_model_config(spec["model_config_dir"])
    if spec.get("synthetic"):  # open_clip's own data path and preprocessing, ids inside the vocabulary
        oc.get_tokenizer = lambda *args, **kwargs: synthetic_tokenizer(spec["model_config_dir"])
        code = oc.main(spec["args"]) or 0
        _report_peak()
        return code
    tokenize = open_clip_tokenizer(load_tokenizer(spec["tokenizer"]), spec["max_length"])
    preprocess = mmpipe_preprocess(spec["image_size"], spec["mean"], spec["std"])
    create = oc.create_model_and_transforms

    def create_model_and_transforms(*args, **kwargs):
        model, _, _ = create(*args, **kwargs)
        return model, preprocess, preprocess
    oc.create_model_and_transforms = create_model_and_transforms
    oc.get_tokenizer = lambda *args, **kwargs: tokenize
    _cpu_ready_ddp()
    return oc.main(spec["args"]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
