"""Zero-shot retrieval: image->text and text->image recall@k over paired features (pair i is the
only correct match of i, so chance recall@k is k/N).

A hit needs the correct item to score strictly above every other: ties (e.g. all-zero features)
and NaN scores count as misses, so degenerate features never read as perfect recall. Rows with
non-finite features are counted in ``nonfinite`` and the record says ``finite: false``."""
from __future__ import annotations

import torch

from mmpipe.models.clip import l2_normalize


def retrieval_metrics(image_features: torch.Tensor, text_features: torch.Tensor, ks=(1, 5)) -> dict:
    img = l2_normalize(image_features.float())
    txt = l2_normalize(text_features.float())
    sim = img @ txt.t()  # (N images, N texts)
    n = sim.shape[0]
    target = torch.arange(n)
    nonfinite = int((~torch.isfinite(image_features.float()).all(1)).sum() + (~torch.isfinite(text_features.float()).all(1)).sum())
    out = {"n": n, "finite": nonfinite == 0, "nonfinite": nonfinite}
    for name, s in (("i2t", sim), ("t2i", sim.t())):
        # rank of the correct item = number of other items scoring at least as high (ties lose);
        # a NaN correct score is never a hit
        correct = s[target, target].unsqueeze(1)
        rank = (s >= correct).sum(dim=1) - 1
        rank = torch.where(torch.isfinite(correct.squeeze(1)), rank, torch.full_like(rank, n))
        for k in ks:
            out[f"{name}_r{k}"] = float((rank < k).float().mean())
    out["chance_r1"] = 1.0 / n
    return out
