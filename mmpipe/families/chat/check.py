"""``mmpipe data check`` on chat data (LLaVA JSON, ms-swift JSONL): every sample read, encoded and its
images decoded exactly as training does (``ChatDataset._load``: the reader's checks - roles, markers
against images, image entries -, truncation at ``data.max_length`` that would drop a sample, every
image decoded), each sample reported for itself."""
from __future__ import annotations

import json
import sys
import tempfile

from mmpipe.config.fields import thawed_copy
from mmpipe.config.resolve import build_family
from mmpipe.config.schema import family_of, replace
from mmpipe.data.tokenizer import load_tokenizer, tokenizer_choice, train_tokenizer


def _tokenizer(cfg, family_cls, samples: list):
    """The tokenizer a run would use: the configured or pretrained one, else the WordPiece mmpipe
    would train on this data (trained here in a temporary directory, as a run does at its start)."""
    tok_dir, what = tokenizer_choice(cfg.data, *family_cls.tokenizer_weights(cfg.model), run_dir=None)
    if tok_dir:  # the configured or pretrained one; load_tokenizer refuses a missing one as a run would
        return family_cls.prepare_tokenizer(load_tokenizer(tok_dir, what))
    with tempfile.TemporaryDirectory() as d:  # trained on every sample's text, as the run does
        return family_cls.prepare_tokenizer(train_tokenizer(family_cls.record_texts(samples),
                                                            cfg.data.tokenizer_vocab_size, d))


def run_chat_check(path: str, cfg, as_json: bool = False, out=None, err=None) -> int:
    """Report every unusable sample (one line each, or every sample as JSON); 0 when the unusable
    fraction is within ``data.max_bad_fraction``, else 1."""
    from tqdm import tqdm

    out, err = out or sys.stdout, err or sys.stderr
    fam_cls = family_of(cfg)
    samples = fam_cls.read_records(path, cfg.data, "--manifest")
    tok = _tokenizer(cfg, fam_cls, samples)
    cfg = replace(cfg, model=fam_cls.resolve(cfg.model, tok, cfg.data))
    family = build_family(cfg.model, cfg.train.seed)
    data_cfg = thawed_copy(cfg.data)
    data_cfg.packing = False  # every sample on its own
    ds = family.dataset(samples, tok, data_cfg)
    bad = 0
    for j in tqdm(range(len(samples)), unit="sample", desc=f"check {path}", file=err, disable=None, mininterval=1.0):
        fields, why = ds._load(j)
        rec = {"where": samples[j].where, "status": "ok" if fields is not None else "bad",
               "why": None if fields is not None else f"{why[0]}: {why[1]}" if why[0] != samples[j].where else why[1],
               "images": len(samples[j].images), "videos": len(samples[j].videos), "tokens": len(fields["input_ids"]) if fields else None,
               "truncated": bool(fields["truncated"]) if fields else None}
        bad += fields is None
        if as_json:
            out.write(json.dumps(rec, ensure_ascii=False) + "\n")
        elif fields is None:
            out.write(f"{rec['where']}: {rec['why']}\n")
    n = len(samples)
    print(f"{path}: {n} samples, {n - bad} usable, {bad} unusable ({100 * bad / max(n, 1):.1f}%)",
          file=err if as_json else out, flush=True)
    if bad > cfg.data.max_bad_fraction * n:
        print(f"mmpipe: error: {bad} of {n} samples of {path} are unusable ({100 * bad / n:.1f}%), over "
              f"data.max_bad_fraction={cfg.data.max_bad_fraction}: fix or drop them, or raise the limit",
              file=err, flush=True)
        return 1
    return 0
