"""Tokenizers: a local transformers tokenizer directory, or a WordPiece tokenizer trained with
``tokenizers`` on the training captions and saved (as a transformers tokenizer) in the run dir."""
from __future__ import annotations

import os

from mmpipe.errors import ConfigError

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # loader workers fork after tokenizer use

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def load_tokenizer(path: str, key: str = "data.tokenizer"):
    from transformers import AutoTokenizer
    if not os.path.isdir(path):
        raise ConfigError(f"{key}: tokenizer directory not found: {path} (give a local save_pretrained dir, "
                          "or unset it to train one on the captions)")
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{key}: cannot load a tokenizer from {path}: {str(e).splitlines()[0]}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.sep_token or tok.unk_token
    return tok


def train_tokenizer(texts, vocab_size: int, out_dir: str):
    """Train a lower-casing WordPiece tokenizer ([CLS] text [SEP]) and save it to ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=1)
    tok.train_from_iterator(texts, trainer=trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", eos_token="[SEP]")
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def eos_id(tok) -> int:
    return tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
