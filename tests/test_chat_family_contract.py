"""The room a native-resolution chat family needs, proven by one defined in this file alone.

``patchchat``: images keep their aspect ratio (longest side scaled to ``max_side``, each side a
multiple of ``patch``) and become ``(h/p)(w/p)`` patch tokens each, so one micro-batch holds images
of different token counts; the patches go to the first stage as one ``(patches, 3p^2)`` tensor, are
embedded, scattered into the image-token positions, then two causal attention blocks (the chat
home's mask kinds: packed rows attend within a sample) and an LM head. It reuses the chat home
(records, encoder, packing, loss, evaluation) and the data layer's decoder; no generic file names it.
Runs import it through ``MMPIPE_PLUGINS=test_chat_family_contract``."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
import torch
from helpers import launch, train_losses
from PIL import Image
from torch import nn

from mmpipe.config.fields import Section, option, thawed_copy
from mmpipe.config.registry import register_family
from mmpipe.families.base import Layer
from mmpipe.families.chat.family import ChatFamily
from mmpipe.families.chat.masks import attention_inputs
from mmpipe.parallel.plain import plain_model

FAMILY_CONFIG = """\
model: {type: patchchat, hidden: 16, patch: 8, max_side: 32}
data: {max_length: 64, tokenizer_vocab_size: 120, num_workers: 0}
parallel: {pipeline_stages: 1, micro_batch_size: 2, placement: modality}
optim: {lr: 1.0e-2, warmup_steps: 0, schedule: constant}
train: {steps: 3, batch_size: 8, precision: fp32, eval_every: 0, save_every: 0, keep_checkpoints: 0}
log: {progress: false}
"""


@dataclass
class PatchChatConfig(Section):
    type: str = option("patchchat", "a toy native-resolution chat model")
    hidden: int = option(16, "width")
    patch: int = option(8, "patch side: an image of h x w pixels is (h/p)(w/p) tokens")
    max_side: int = option(32, "the longest image side after resizing (aspect ratio kept)")
    vocab_size: Optional[int] = option(None, "unset = the tokenizer's size")
    image_token_id: Optional[int] = option(None, "unset = the tokenizer's <image>")


class PatchPixels:
    """Native-resolution image input: each image its own grid; a batch is every patch in order."""

    cache_size = None  # no square cache holds these

    def __init__(self, patch: int, max_side: int):
        self.p, self.max_side = patch, max_side

    def grid(self, w: int, h: int) -> tuple:
        s = self.max_side / max(w, h)
        return max(1, round(h * s / self.p)), max(1, round(w * s / self.p))

    def tokens(self, path) -> int:
        with Image.open(path) as im:
            gh, gw = self.grid(*im.size)
        return gh * gw

    def load(self, path, what, sample_id, epoch, draft=False):
        try:
            with Image.open(path) as im:
                gh, gw = self.grid(*im.size)
                im = im.convert("RGB").resize((gw * self.p, gh * self.p), Image.BICUBIC)
        except Exception as e:  # noqa: BLE001 - a corrupt or missing file is the sample's error
            return None, f"cannot decode ({type(e).__name__})"
        return torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).contiguous(), None

    def batch(self, images: list) -> dict:
        p = self.p
        flat = [im.unfold(1, p, p).unfold(2, p, p).permute(1, 2, 0, 3, 4).reshape(-1, 3 * p * p) for im in images]
        return {"pixel_values": torch.cat(flat) if flat else torch.zeros((0, 3 * p * p), dtype=torch.uint8)}


class Block(nn.Module):
    def __init__(self, d: int, heads: int = 2):
        super().__init__()
        self.heads, self.norm, self.qkv, self.out = heads, nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, h, mask):
        _, attn, _ = attention_inputs(mask, h.dtype)  # None: causal rows; block-diagonal: packed rows
        B, T, D = h.shape
        q, k, v = self.qkv(self.norm(h)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn, is_causal=attn is None)
        return h + self.out(o.transpose(1, 2).reshape(B, T, D))


class Embed(nn.Module):
    def __init__(self, vocab: int, d: int, image_id: int):
        super().__init__()
        self.tok, self.image_id = nn.Embedding(vocab, d), image_id


def patch_step(part, acts):
    pix, ids, mask = acts
    return part(pix.float() / 255.0), ids, mask


def embed_step(part, acts):  # image features replace the image tokens, in order
    feats, ids, mask = acts
    h = part.tok(ids)
    return h.masked_scatter((ids == part.image_id)[..., None], feats.to(h.dtype)), ids, mask


def block_step(part, acts):
    h, ids, mask = acts
    return part(h, mask), ids, mask


def head_step(part, acts):
    return part(acts[0])


@register_family
class PatchChatFamily(ChatFamily):
    name = "patchchat"
    config_class = PatchChatConfig
    default_groups = {"vision": [r"^vision\."], "llm": [r"^llm\."]}

    @classmethod
    def pixels(cls, model_cfg, data_cfg, seed=None):
        return PatchPixels(model_cfg.patch, model_cfg.max_side)

    @classmethod
    def resolve(cls, model_cfg, tokenizer, data_cfg):
        out = thawed_copy(model_cfg)
        cls.resolve_image_token(out, tokenizer)
        out.vocab_size = out.vocab_size or len(tokenizer)
        return out

    def __init__(self, model_cfg, seed: int = 0):
        super().__init__(model_cfg, seed)
        self.image_token_id, self._pixels = model_cfg.image_token_id, self.pixels(model_cfg, None)

    def image_tokens(self, image, data_cfg=None) -> int:
        return self._pixels.tokens(image)

    def layers(self):
        return [Layer("vision.patch", "vision", patch_step), Layer("llm.embed", "llm", embed_step, takes=("vision",)),
                Layer("llm.blocks.0", "llm", block_step), Layer("llm.blocks.1", "llm", block_step),
                Layer("llm.head", "llm", head_step)]

    def build_unseeded(self, name):
        c = self.cfg
        return {"vision.patch": lambda: nn.Linear(3 * c.patch ** 2, c.hidden),
                "llm.embed": lambda: Embed(c.vocab_size, c.hidden, c.image_token_id),
                "llm.head": lambda: nn.Linear(c.hidden, c.vocab_size)}.get(name, lambda: Block(c.hidden))()

    def example_batch(self, m, max_length, device, packed=False, tokens=4):
        ids = torch.randint(0, self.cfg.vocab_size, (m, max_length), generator=torch.Generator().manual_seed(0))
        ids[ids == self.image_token_id] = 0
        ids[:, :tokens] = self.image_token_id  # one image of ``tokens`` patches per row
        return {"pixel_values": torch.zeros((tokens * m, 3 * self.cfg.patch ** 2), dtype=torch.uint8).to(device),
                "input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device), "labels": ids.to(device)}

    def example_batches(self, m, max_length, device, packed=False, data_cfg=None):  # its data: 3 small, 1 large
        return [(3.0, self.example_batch(m, max_length, device, tokens=4)),
                (1.0, self.example_batch(m, max_length, device, tokens=16))]


# ---- the data: images of mixed sizes, 1 or 2 per conversation ------------------------------------
SIZES = [(32, 16), (16, 32), (24, 24), (32, 32), (8, 24), (40, 24)]  # (w, h) -> 8, 8, 16, 16, 4, 8 tokens
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


@pytest.fixture(scope="module")
def mixed_chat(tmp_path_factory):
    d = tmp_path_factory.mktemp("patchchat")
    rng = np.random.default_rng(0)
    rows = []
    for i in range(40):
        names, paths = list(COLOURS)[i % 3], []
        for k in range(1 + i % 2):
            w, h = SIZES[(i + k) % len(SIZES)]
            path = d / f"{i}_{k}.png"
            Image.new("RGB", (w, h), COLOURS[names]).save(path)
            paths.append(path.name)
        q = "<image>" * len(paths) + f"\nwhat colour is it? {' '.join(rng.choice(['please', 'now', 'tell'], 2))}"
        rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": names}],
                     "images": paths})
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = d / "patchchat.yaml"
    cfg.write_text(FAMILY_CONFIG)
    return {"dir": d, "train": str(d / "train.jsonl"), "config": str(cfg)}


def test_images_keep_their_aspect_and_give_their_own_token_counts(mixed_chat):
    """Each image its own grid and token count, several sizes in one micro-batch; the plain model
    scatters every patch into its image token and trains."""
    import mmpipe
    from mmpipe.data.tokenizer import train_tokenizer
    from mmpipe.families.chat.records import read_chat
    samples = read_chat(mixed_chat["train"])
    tok = PatchChatFamily.prepare_tokenizer(train_tokenizer(PatchChatFamily.record_texts(samples), 120,
                                                            str(mixed_chat["dir"] / "tok")))
    cfg = mmpipe.load_config(mixed_chat["config"])
    fam = PatchChatFamily(PatchChatFamily.resolve(cfg.model, tok, cfg.data))
    ds, collate = fam.dataset(samples, tok, cfg.data), fam.collate(tok, cfg.data)
    b = collate([ds[0], ds[1], ds[2]])  # images of 32x16, then 16x32 + 24x24 (to 32x32), then 24x24
    assert [fam.image_tokens(mixed_chat["dir"] / n) for n in ("0_0.png", "1_0.png", "1_1.png", "4_0.png")] == [8, 8, 16, 4]
    assert tuple(ds[1]["images"][0].shape) == (3, 32, 16) and tuple(ds[1]["images"][1].shape) == (3, 32, 32)
    n_img = int((b["input_ids"] == fam.image_token_id).sum())
    assert n_img == 8 + (8 + 16) + 16 and b["pixel_values"].shape == (n_img, 3 * 64)
    loss = plain_model(fam)(b["pixel_values"], b["input_ids"], b["attention_mask"], b["labels"])
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_the_profile_weighs_the_familys_shapes(mixed_chat):
    """``example_batches`` is a distribution: times are its weighted mean, bytes its largest."""
    import mmpipe
    from mmpipe.planning.offline import resolve_for_plan
    from mmpipe.planning.profiler import LayerCost, mixed_costs
    cfg, fam = resolve_for_plan(mmpipe.load_config(mixed_chat["config"]))
    assert [w for w, _ in fam.example_batches(2, 64, "cpu")] == [3.0, 1.0]
    a = LayerCost("x", 1.0, 2.0, 100, 10, 0, 0, 0, in_bytes=None)
    b = LayerCost("x", 5.0, 6.0, 300, 5, 0, 0, 0, in_bytes=7)
    m = mixed_costs([(3.0, [a]), (1.0, [b])])[0]
    assert (m.fwd_ms, m.bwd_ms, m.act_bytes, m.out_bytes, m.in_bytes) == (2.0, 3.0, 300, 10, 7)
    from mmpipe.planning.measure import get_profile

    def only(tokens):  # the family with one shape of its distribution
        f = type(fam)(cfg.model)
        f.example_batches = lambda m, n, device, packed=False, data_cfg=None: [
            (1.0, fam.example_batch(m, n, device, tokens=tokens))]
        return f

    def act_bytes(f):
        prof = get_profile(cfg, f, 2, use_cache=False, measure_comm=False, passes=1, repeats=1)
        return [la["act_bytes"] for la in prof["layers"]]
    mixed, small, large = act_bytes(fam), act_bytes(only(4)), act_bytes(only(16))
    assert mixed == [max(x, y) for x, y in zip(small, large)] and small[0] < large[0]


def test_the_profile_shows_its_progress_is_bounded_by_the_run_and_says_when_it_is_reused(mixed_chat, tmp_path,
                                                                                          monkeypatch):
    """Per shape, a progress line; a profile that would cost more than ``PROFILE_SHARE`` of the run it plans
    (here: a run of one micro-batch) is cut to one pass a shape and fewer timed rounds, and says so; the next
    run's reuse of the cached profile is said."""
    import mmpipe
    from mmpipe.planning.measure import PROFILE_SHARE, get_profile
    from mmpipe.planning.offline import resolve_for_plan
    monkeypatch.setenv("MMPIPE_CACHE", str(tmp_path / "cache"))
    cfg, fam = resolve_for_plan(mmpipe.load_config(mixed_chat["config"]))
    lines = []
    prof = get_profile(cfg, fam, 2, measure_comm=False, passes=3, log=lines.append, run_micro_batches=1)
    assert prof["passes"] == 1, lines
    assert any(f"profile bounded to {PROFILE_SHARE:.0%} of the run it plans: 1 pass(es) a shape (was 3), 1 warm-up + 2 "
               "timed rounds" in x for x in lines), lines
    assert [x.split(" (")[0] for x in lines if x.startswith("profiled shape")] == ["profiled shape 1/2",
                                                                                 "profiled shape 2/2"], lines
    long_run = get_profile(cfg, fam, 2, measure_comm=False, passes=2, use_cache=False, run_micro_batches=10**9)
    assert long_run["passes"] == 2  # a long run keeps its passes
    lines.clear()
    get_profile(cfg, fam, 2, measure_comm=False, passes=3, log=lines.append, run_micro_batches=1)
    assert len(lines) == 1 and lines[0].startswith("reusing the cached layer profile of this model"), lines


# (P = 2 alone: P2 x DP2 pipelines the same two stages; every family's P = 2 parity is in test_parity.py)
LAYOUTS = {"p1": (1, ["parallel.pipeline_stages=1"], "python"), "p2dp2": (4, ["parallel.pipeline_stages=2"], "deepspeed")}


@pytest.mark.dist
@pytest.mark.parametrize("packing", [False, True])
def test_mixed_sizes_train_alike_in_every_layout(mixed_chat, tmp_path, packing):
    """P = 1 and P2 x DP2 on chat data whose images differ in token count within a
    micro-batch: the same losses (rtol 1e-5), with packing off and on (and packing really packs)."""
    from mmpipe.train.metrics import read_metrics
    losses, seen = {}, {}
    for name, (n, sets, launcher) in LAYOUTS.items():
        out = str(tmp_path / name)
        args = ["--config", mixed_chat["config"], "--set", f"data.train={mixed_chat['train']}",
                "--set", f"train.output_dir={out}", "--set", f"data.packing={str(packing).lower()}"]
        launch(n, args + [a for s in sets for a in ("--set", s)], launcher,
               env={"MMPIPE_PLUGINS": "test_chat_family_contract"})
        losses[name] = train_losses(out)
        seen[name] = [r["samples_seen"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))]
    assert len(losses["p1"]) == 3 and all(np.isfinite(losses["p1"]))
    # packing is on where asked: 8 rows a step hold more than 8 conversations (the same in every layout)
    assert seen["p2dp2"] == seen["p1"] and (seen["p1"][-1] > 24 if packing else seen["p1"][-1] == 24)
    np.testing.assert_allclose(losses["p2dp2"], losses["p1"], rtol=1e-5, err_msg="p2dp2")
