"""Zero-shot retrieval: image->text and text->image recall@k over paired features (pair i is the
only correct match of i, so chance recall@k is k/N).

A hit needs the correct item to score strictly above every other: ties (e.g. all-zero features)
and NaN scores count as misses, so degenerate features never read as perfect recall. Rows with
non-finite features are counted in ``nonfinite`` and the record says ``finite: false``."""
from __future__ import annotations

import torch

from mmpipe.families.clip.model import l2_normalize


def retrieval_metrics(image_features: torch.Tensor, text_features: torch.Tensor, ks=(1, 5),
                      captions=None) -> dict:
    """Recall@k both ways. ``captions`` (one per pair), when given, makes every pair with the same
    caption a correct match too (a data set that repeats captions would otherwise score its exact
    duplicates as misses)."""
    img = l2_normalize(image_features.float())
    txt = l2_normalize(text_features.float())
    sim = img @ txt.t()  # (N images, N texts)
    n = sim.shape[0]
    if captions is None:
        match = torch.eye(n, dtype=torch.bool)
    else:
        ids = {c: i for i, c in enumerate(dict.fromkeys(captions))}
        code = torch.tensor([ids[c] for c in captions])
        match = code[:, None] == code[None, :]
    nonfinite = int((~torch.isfinite(image_features.float()).all(1)).sum() + (~torch.isfinite(text_features.float()).all(1)).sum())
    out = {"n": n, "finite": nonfinite == 0, "nonfinite": nonfinite}
    for name, s in (("i2t", sim), ("t2i", sim.t())):
        # rank of the best correct item = number of wrong items scoring at least as high (ties
        # lose); a NaN score is never a hit
        best = torch.where(match, s.nan_to_num(float("-inf")), torch.full_like(s, float("-inf"))).amax(1, keepdim=True)
        rank = ((s >= best) & ~match).sum(dim=1)
        rank = torch.where(torch.isfinite(best.squeeze(1)), rank, torch.full_like(rank, n))
        for k in ks:
            out[f"{name}_r{k}"] = float((rank < k).float().mean())
    out["chance_r1"] = 1.0 / n
    return out
