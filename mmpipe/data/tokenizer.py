"""Tokenizers: a local transformers tokenizer directory, or a WordPiece tokenizer trained with
``tokenizers`` on the training captions and saved (as a transformers tokenizer) in the run dir."""
from __future__ import annotations

import os
from typing import Optional

from mmpipe.config.hub import not_found
from mmpipe.errors import ConfigError

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # loader workers fork after tokenizer use

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def load_tokenizer(path: str, key: str = "data.tokenizer"):
    from transformers import AutoTokenizer
    if not os.path.isdir(path):
        raise ConfigError(not_found(path, key, "tokenizer directory") + " - or unset it to train one on the captions")
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{key}: cannot load a tokenizer from {path}: {str(e).splitlines()[0]}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.sep_token or tok.unk_token
    return tok


def train_tokenizer(texts, vocab_size: int, out_dir: str):
    """Build a lower-casing WordPiece tokenizer ([CLS] text [SEP]) from the captions and save it.

    The vocabulary is chosen deterministically (special tokens, every character seen, with its
    ``##`` continuation form, then whole words by descending count, ties by spelling), so the same
    captions give the same token ids in every process: ``tokenizers``' own WordPiece trainer does
    not (its tie-breaking follows a per-process hash order), which would give each run of the same
    config different embeddings.
    """
    from collections import Counter

    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    norm = normalizers.BertNormalizer(lowercase=True)
    pre = pre_tokenizers.BertPreTokenizer()
    counts: Counter = Counter()
    chars: set = set()
    for text in texts:
        for word, _ in pre.pre_tokenize_str(norm.normalize_str(text)):
            counts[word] += 1
            chars.update(word)
    alphabet = sorted(chars)
    base = SPECIALS + alphabet + ["##" + c for c in alphabet]
    taken = set(base)
    words = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if w not in taken]
    vocab = {t: i for i, t in enumerate(base + words[:max(0, vocab_size - len(base))])}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = norm
    tok.pre_tokenizer = pre
    cls_id, sep_id = vocab["[CLS]"], vocab["[SEP]"]
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", eos_token="[SEP]")
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


class StandInTokenizer:
    """What ``Family.resolve`` reads of the tokenizer a run would train, without training it
    (``mmpipe plan``): its size, the EOS id of mmpipe's WordPiece ([SEP] = 3), and the family's
    special tokens appended after the vocabulary."""

    def __init__(self, size: int, specials=()):
        self._vocab = {t: size + i for i, t in enumerate(specials)}
        self._size = size + len(self._vocab)
        self.eos_token_id = self.sep_token_id = SPECIALS.index("[SEP]")
        self.pad_token_id = 0

    def __len__(self) -> int:
        return self._size

    def convert_tokens_to_ids(self, token: str) -> int:
        return self._vocab[token]

    def get_vocab(self) -> dict:
        return dict(self._vocab)


def eos_id(tok) -> int:
    return tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model")


def has_tokenizer(path: str) -> bool:
    """Whether a local directory holds a transformers tokenizer (e.g. a save_pretrained model dir)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def tokenizer_choice(data_cfg, weights_key: Optional[str], weights_dir: Optional[str],
                     run_dir: Optional[str]) -> tuple:
    """(directory, what it is) of the tokenizer a run uses, the one rule for training, export and
    planning: ``data.tokenizer``, else the cache's (its ids were made with it), else the pretrained
    text weights' own, else the one mmpipe trains into the run directory (``run_dir``; None: not
    asked, and (None, None) is returned)."""
    if data_cfg.tokenizer:
        return data_cfg.tokenizer, "data.tokenizer"
    if data_cfg.cache:
        return os.path.join(data_cfg.cache, "tokenizer"), "data.cache tokenizer"
    if weights_dir and has_tokenizer(weights_dir):
        return weights_dir, f"{weights_key} tokenizer"
    if run_dir is None:
        return None, None
    return os.path.join(run_dir, "tokenizer"), "tokenizer in the run directory"
