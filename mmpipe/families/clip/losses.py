"""The dual encoders' losses over a batch of (image, text) feature pairs, and their value and
gradients computed in row blocks of the B x B logits.

``ClipLoss`` (``model.loss: softmax``): symmetric InfoNCE with a learnable temperature, open_clip's
``ClipLoss`` on one process. ``SigmoidLoss`` (``model.loss: sigmoid``): SigLIP's pairwise sigmoid
loss with a learnable temperature and bias, open_clip's ``SigLipLoss`` and transformers'
``SiglipModel`` loss: -sum over all B^2 pairs of log sigmoid(z_ij * logit_ij) / B, z = +1 on the
diagonal and -1 elsewhere.

``loss_and_grads`` gives the loss of a whole global batch and its gradient for every feature and
loss parameter while holding only ``block`` rows of the logits at once (O(block x B) memory, not
O(B^2)): the sigmoid loss is a sum over pairs, so each block's share is independent; the softmax
loss's text->image term is per row, and its image->text term needs each column's log-sum-exp over
all rows, computed first block by block without a graph; its gradient in a block is then
softmax_ij = exp(logit_ij - lse_j), applied through a surrogate <stop_grad(softmax), logits>.

With ``rows`` (``model.local_loss``: each data-parallel rank its own samples), it gives the share of
the loss in the logits' rows ``start:stop`` (those texts against every image) and that share's
gradient for every feature and parameter: the shares of all ranks sum to the whole loss and its
gradients. The sigmoid loss's rows are independent; the softmax loss's image->text term needs each
column's log-sum-exp over every row, which ``combine_columns`` completes from each rank's partial
one over its own rows (an all-gather of B numbers per rank). Each rank thus computes rows x B
logits, not B x B, and only the image features' gradients reach other ranks.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    # same arithmetic as transformers' CLIPModel (x / sqrt(sum(x^2)))
    return x / torch.pow(torch.sum(torch.pow(x, 2), dim=-1, keepdim=True), 0.5)


class ClipLoss(nn.Module):
    """Symmetric InfoNCE over the pairs it is given, with a learnable temperature (``logit_scale``):
    open_clip's ``ClipLoss`` on one process. With ``model.negatives: global`` it is given the features
    of the whole global batch (``ClipFamily.batch_loss``); with ``micro_batch``, the loss layer calls
    it on one micro-batch and a step's loss is the mean over its micro-batches."""
    kind = "softmax"
    needs_columns = True  # its image->text term: each column's log-sum-exp over every row
    pair_bytes = 20  # held per pair by autograd through the whole loss (5 fp32 B x B matrices at the peak)

    def __init__(self, logit_scale_init: float):
        super().__init__()
        # shape (1,), not 0-dim: DeepSpeed's parameter broadcast cannot view a 0-dim tensor as bytes.
        # transformers' 0-dim ``logit_scale`` is reshaped on load (models/hf.py).
        self.logit_scale = nn.Parameter(torch.tensor([float(logit_scale_init)]))

    def scale(self) -> torch.Tensor:
        return self.logit_scale.float().exp().clamp(max=100.0).squeeze()

    def logits_per_text(self, image_features, text_features):
        img = l2_normalize(image_features.float())
        txt = l2_normalize(text_features.float())
        return torch.matmul(txt, img.t()) * self.scale()

    def forward(self, image_features, text_features, rows=None, cols=None):
        if rows is not None:  # the share of rows ``rows`` (ZeRO-3: through forward, which gathers the parameters)
            return rows_surrogate(self, image_features, text_features, rows, cols)
        logits = self.logits_per_text(image_features, text_features)
        target = torch.arange(logits.shape[0], device=logits.device)
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2.0

    # ---- in row blocks (normalized features) ----------------------------------------------------
    def columns(self, img_n, txt_n, block: int):
        """Each image column's log-sum-exp over all text rows, block by block, without a graph."""
        with torch.no_grad():
            scale, lse = self.scale(), None
            for s in range(0, txt_n.shape[0], block):
                part = torch.logsumexp(txt_n[s:s + block] @ img_n.t() * scale, dim=0)
                lse = part if lse is None else torch.logaddexp(lse, part)
        return lse

    def block_logits(self, img_n, txt_n) -> torch.Tensor:
        return txt_n @ img_n.t() * self.scale()

    def block(self, img_n, txt_n, start: int, cols, logits=None) -> tuple:
        """(this block's share of the loss value, a function of the graph with its share of the
        gradient): rows ``start:start+b`` of ``txt_n`` (``txt_n`` already sliced; ``logits``: its
        ``block_logits`` when already computed)."""
        n, b = img_n.shape[0], txt_n.shape[0]
        logits = self.block_logits(img_n, txt_n) if logits is None else logits
        idx = torch.arange(b, device=logits.device)
        diag = logits[idx, start + idx]
        rows = torch.logsumexp(logits, dim=1) - diag  # text -> image cross entropy of each row
        value = (rows.sum() - diag.sum()) / (2 * n)  # the image -> text term's diagonal (its lse: see ``total``)
        soft = torch.exp(logits.detach() - cols)  # d lse_j / d logit_ij
        return value, value + ((soft * logits).sum() - (soft * logits).sum().detach()) / (2 * n)

    def total(self, cols, n: int) -> torch.Tensor:
        return cols.sum() / (2 * n)


class SigmoidLoss(nn.Module):
    """SigLIP's sigmoid loss over every pair of the features it is given, with a learnable
    temperature (``logit_scale``, SigLIP's init log 10) and bias (``logit_bias``, init -10), both
    shape (1,) as ``ClipLoss``'s. The temperature is not clamped (transformers' and big_vision's
    arithmetic)."""
    kind = "sigmoid"
    needs_columns = False
    pair_bytes = 24  # (6 fp32 B x B matrices)

    def __init__(self, logit_scale_init: float, logit_bias_init: float):
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor([float(logit_scale_init)]))
        self.logit_bias = nn.Parameter(torch.tensor([float(logit_bias_init)]))

    def scale(self) -> torch.Tensor:
        return self.logit_scale.float().exp().squeeze()

    def logits_per_text(self, image_features, text_features):
        img = l2_normalize(image_features.float())
        txt = l2_normalize(text_features.float())
        return torch.matmul(txt, img.t()) * self.scale() + self.logit_bias.float().squeeze()

    def forward(self, image_features, text_features, rows=None, cols=None):
        if rows is not None:
            return rows_surrogate(self, image_features, text_features, rows, cols)
        logits = self.logits_per_text(image_features, text_features)
        n = logits.shape[0]
        labels = 2 * torch.eye(n, device=logits.device, dtype=logits.dtype) - 1
        return -F.logsigmoid(labels * logits).sum() / n

    def columns(self, img_n, txt_n, block: int):
        return None

    def block_logits(self, img_n, txt_n) -> torch.Tensor:
        return txt_n @ img_n.t() * self.scale() + self.logit_bias.float().squeeze()

    def block(self, img_n, txt_n, start: int, cols, logits=None) -> tuple:
        n, b = img_n.shape[0], txt_n.shape[0]
        logits = self.block_logits(img_n, txt_n) if logits is None else logits
        labels = torch.full_like(logits, -1.0)
        idx = torch.arange(b, device=logits.device)
        labels[idx, start + idx] = 1.0
        value = -F.logsigmoid(labels * logits).sum() / n
        return value, value

    def total(self, cols, n: int) -> torch.Tensor:
        return torch.zeros(())


def loss_and_grads(module: nn.Module, img: torch.Tensor, txt: torch.Tensor, params: list, block: int,
                   rows: tuple = None, combine_columns=None) -> tuple:
    """The loss of every pair of ``img`` x ``txt`` (rows = samples) by ``module`` (``ClipLoss`` or
    ``SigmoidLoss``), with its gradient for ``img``, ``txt`` and each of ``params`` (the module's
    trainable parameters; zeros when unused): (loss, img_grad, txt_grad, [param grads]). Holds at
    most ``block`` rows of the logits (and their gradient) at once.

    ``rows`` = (start, stop): only the share of the logits' rows start:stop (see the module
    docstring), the constant of the columns' log-sum-exp counted by the share that starts at row 0;
    ``combine_columns(partial)``: the columns' log-sum-exp over every row from this share's partial
    one (identity when the rows are all of them)."""
    img = img.detach().float().requires_grad_(True)
    txt = txt.detach().float().requires_grad_(True)
    n = img.shape[0]
    start, stop = rows if rows is not None else (0, n)
    combine = combine_columns or (lambda c: c)
    with torch.enable_grad():
        img_n, txt_n = l2_normalize(img), l2_normalize(txt)
    a, t = img_n.detach().requires_grad_(True), txt_n.detach().requires_grad_(True)
    ga, gt = torch.zeros_like(a), torch.zeros_like(t)
    gp = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    value = torch.zeros((), dtype=torch.float64)
    kept = None  # one block covering the rows: its logits serve the columns' pass and the gradient's
    if module.needs_columns and stop - start <= block:
        with torch.enable_grad():
            kept = module.block_logits(a, t[start:stop])
        cols = combine(torch.logsumexp(kept.detach(), dim=0))
    else:
        cols = module.columns(a.detach(), t.detach()[start:stop], block)
        cols = combine(cols) if cols is not None else None
    if cols is not None and start == 0:
        value = value + module.total(cols, n).detach().double()
    for s in range(start, stop, block):
        with torch.enable_grad():
            v, surrogate = module.block(a, t[s:min(s + block, stop)], s, cols, logits=kept)
            grads = torch.autograd.grad(surrogate, [a, t] + list(params), allow_unused=True)
        value = value + v.detach().double()
        ga += grads[0]
        if grads[1] is not None:
            gt += grads[1]
        for acc, g in zip(gp, grads[2:]):
            if g is not None:
                acc += g.float()
    gi, gtx = torch.autograd.grad([img_n, txt_n], [img, txt], [ga, gt])
    return value.float(), gi, gtx, gp


def rows_surrogate(module: nn.Module, img: torch.Tensor, txt: torch.Tensor, rows: tuple, cols) -> torch.Tensor:
    """A function of the loss module's parameters whose gradient is the share of rows ``rows`` (as
    ``loss_and_grads``; ``cols``: the columns' log-sum-exp over every row, None for the sigmoid loss),
    the features taken as constants: ZeRO-3's way to the parameters' gradient through ``forward``."""
    start, stop = rows
    a, t = l2_normalize(img.detach().float()), l2_normalize(txt.detach().float())
    return module.block(a, t[start:stop], start, cols)[1]
