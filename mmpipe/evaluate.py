"""Zero-shot retrieval: image->text and text->image recall@k over paired features (pair i is the
only correct match of i, so chance recall@k is k/N)."""
from __future__ import annotations

import torch

from mmpipe.models.clip import l2_normalize


def retrieval_metrics(image_features: torch.Tensor, text_features: torch.Tensor, ks=(1, 5)) -> dict:
    img = l2_normalize(image_features.float())
    txt = l2_normalize(text_features.float())
    sim = img @ txt.t()  # (N images, N texts)
    n = sim.shape[0]
    target = torch.arange(n)
    out = {"n": n}
    for name, s in (("i2t", sim), ("t2i", sim.t())):
        # rank of the correct item = number of items scoring strictly higher
        correct = s[target, target].unsqueeze(1)
        rank = (s > correct).sum(dim=1)
        for k in ks:
            out[f"{name}_r{k}"] = float((rank < k).float().mean())
    out["chance_r1"] = 1.0 / n
    return out
