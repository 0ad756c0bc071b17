"""Expert parallelism's half inside the model: a fused-experts module (transformers' MoE experts: ``gate_up_proj``
[E, 2I, H] and ``down_proj`` [E, H, I], ``num_experts``) split over the ``E``-rank expert-parallel group of a
data-parallel group (``shard_experts``: each rank keeps a contiguous slice of E / ``size`` experts), and the token
exchange that runs it dropless (``dispatch``), the same arithmetic as transformers' ``grouped_mm`` path on one rank.

``dispatch``: the routed (token, expert) pairs sorted by expert (a stable sort: one order on every rank), the counts
per destination rank exchanged, the rows sent with an autograd all-to-all of uneven splits (its backward is the
reverse exchange: each token's gradient comes home, each expert's gradient is the sum over every rank's tokens), the
local experts' grouped products, the rows sent back, weighted by the router and summed over top-k in transformers'
order. Every rank of the group calls each exchange at the same point of the forward and of the backward (the
data-parallel ranks of a stage run the same order): a rank that receives no row still joins both, its products tied
to the graph. The half outside the model (the groups, DeepSpeed's expert reduction, clipping and checkpoints over the
slices) is ``parallel.experts`` and ``train``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

SLICED = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias", "up_proj", "up_proj_bias")


@dataclass(frozen=True)
class ExpertShard:
    """This rank's place in its expert-parallel group: ``rank`` of ``size``, over ``group`` (a process group whose
    ranks are consecutive data-parallel ranks of one stage); ``group_name`` is DeepSpeed's name for its groups
    (``ep_size_N``: expert parameters are reduced over the matching expert-data-parallel group)."""
    group: Any
    rank: int
    size: int
    group_name: str

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a tensor over every expert (dim 0)."""
        n = full.shape[0] // self.size
        return full[self.rank * n:(self.rank + 1) * n]

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        """The tensor over every expert from each rank's slice (a collective over the group)."""
        parts = [torch.empty_like(part) for _ in range(self.size)]
        dist.all_gather(parts, part.contiguous(), group=self.group)
        return torch.cat(parts, dim=0)


def is_fused_experts(m: nn.Module) -> bool:
    p = m._parameters.get("gate_up_proj", m._parameters.get("up_proj"))
    return isinstance(getattr(m, "num_experts", None), int) and isinstance(p, nn.Parameter) and p.dim() == 3


def shard_of(p) -> "ExpertShard | None":
    """The shard of an expert parameter (``shard_experts``), None for any other."""
    return getattr(p, "mmpipe_shard", None)


# An expert parameter holds its experts' rows (dim 0: the fused tensors, a parameter LoRA's ``lora_A`` [r E, in]),
# or, for a parameter LoRA's ``lora_B`` [out, r E] (peft: ``reshape(out, r, E)``), every ``r``-th column group
# interleaved: ``mmpipe_interleave`` = E's stride there (r).
def whole(p, part: torch.Tensor) -> torch.Tensor:
    """Every expert's tensor of ``p`` from this rank's ``part`` (a collective over its expert group); any other
    parameter's as it is."""
    shard = shard_of(p)
    if shard is None:
        return part
    part = part.reshape(p.shape)
    r = getattr(p, "mmpipe_interleave", None)
    if r is None:
        return shard.gather(part)
    parts = [torch.empty_like(part) for _ in range(shard.size)]
    dist.all_gather(parts, part.contiguous(), group=shard.group)
    out = torch.cat([q.reshape(q.shape[0], r, -1) for q in parts], dim=2)
    return out.reshape(part.shape[0], -1)


def mine(p, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of every expert's tensor ``full`` for an expert parameter ``p``; any other as it is."""
    shard = shard_of(p)
    if shard is None:
        return full
    r = getattr(p, "mmpipe_interleave", None)
    if r is None:
        return shard.take(full).contiguous()
    cols = full.reshape(full.shape[0], r, -1)
    n = cols.shape[2] // shard.size
    return cols[:, :, shard.rank * n:(shard.rank + 1) * n].reshape(full.shape[0], -1).contiguous()


def whole_shape(p) -> tuple:
    """A parameter's shape over every expert (a checkpoint's)."""
    shard = shard_of(p)
    if shard is None:
        return tuple(p.shape)
    if getattr(p, "mmpipe_interleave", None) is not None:
        return (p.shape[0], p.shape[1] * shard.size)
    return (p.shape[0] * shard.size,) + tuple(p.shape[1:])


def _mark(q: nn.Parameter, shard: ExpertShard, interleave=None) -> nn.Parameter:
    q.allreduce, q.group_name, q.mmpipe_shard = False, shard.group_name, shard
    if interleave is not None:
        q.mmpipe_interleave = interleave
    return q


def _split_parameter_lora(m: nn.Module, shard: ExpertShard) -> None:
    """A parameter LoRA on fused experts (peft's ``ParamWrapper``: ``lora_A`` [r E, in], ``lora_B`` [out, r E], one
    rank-r update per expert): this rank's experts' rows of A and columns of B kept, ``num_experts`` local."""
    E = m.num_experts
    if E % shard.size:
        raise ValueError(f"{E} experts do not split over {shard.size} expert-parallel ranks")
    for key in list(m.lora_A.keys()):
        a, b = m.lora_A[key], m.lora_B[key]
        r = a.weight.shape[0] // E
        for lin, interleave in ((a, None), (b, r)):  # (``mine`` slices each as a checkpoint's tensor is sliced)
            q = _mark(nn.Parameter(torch.empty(0), requires_grad=lin.weight.requires_grad), shard, interleave)
            q.data = mine(q, lin.weight.data).clone()
            lin.weight = q
        a.out_features = b.in_features = a.weight.shape[0]
    m.num_experts = E // shard.size
    m.mmpipe_shard = shard


def is_parameter_lora(m: nn.Module) -> bool:
    """peft's ``ParamWrapper`` over several experts (a parameter LoRA on fused experts)."""
    return hasattr(m, "parameter_name") and hasattr(m, "lora_A") and getattr(m, "num_experts", 1) > 1


def shard_experts(module: nn.Module, shard: ExpertShard) -> int:
    """Keep this rank's slice of every fused-experts module's tensors (as new parameters, marked for DeepSpeed's expert
    reduction: ``allreduce = False``, ``group_name``), and of a parameter LoRA's adapters on them, and route their
    forward through ``dispatch``. Returns the number of modules split."""
    n = 0
    for m in module.modules():
        if is_parameter_lora(m) and getattr(m, "mmpipe_shard", None) is None:
            _split_parameter_lora(m, shard)
    for m in module.modules():
        if not is_fused_experts(m) or getattr(m, "mmpipe_shard", None) is not None:
            continue
        if m.num_experts % shard.size:
            raise ValueError(f"{m.num_experts} experts do not split over {shard.size} expert-parallel ranks")
        for name in SLICED:
            p = m._parameters.get(name)
            if p is None:
                continue
            m._parameters[name] = _mark(nn.Parameter(shard.take(p.data).clone(), requires_grad=p.requires_grad), shard)
        m.mmpipe_global_experts = m.num_experts
        m.num_experts = m.num_experts // shard.size
        m.mmpipe_shard = shard
        n += 1
    return n


class _AllToAll(torch.autograd.Function):
    """Rows exchanged with uneven splits; the backward sends each row's gradient back where the row came from."""

    @staticmethod
    def forward(ctx, rows, send: list, recv: list, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def dispatch(experts: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
             local: Callable) -> torch.Tensor:
    """The experts' output [T, H] for ``hidden`` [T, H] routed to global experts ``top_k_index`` [T, k] with weights
    ``top_k_weights``, the experts spread over ``experts.mmpipe_shard``'s group; ``local(experts, rows, ids,
    weights)`` runs this rank's experts (transformers' forward with local ids, top-1, weight 1)."""
    shard: ExpertShard = experts.mmpipe_shard
    T, k = top_k_index.shape
    n_local = experts.num_experts
    ids = top_k_index.reshape(-1)
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    dest = torch.div(sorted_ids, n_local, rounding_mode="floor")
    send_n = torch.bincount(dest, minlength=shard.size).to(torch.int64)
    recv_n = torch.empty_like(send_n)
    dist.all_to_all_single(recv_n, send_n, group=shard.group)
    send, recv = send_n.tolist(), recv_n.tolist()  # (the splits: one host read per MoE layer)
    rows = _AllToAll.apply(hidden[order // k], send, recv, shard.group)
    got_ids = sorted_ids.new_empty(sum(recv))
    dist.all_to_all_single(got_ids, (sorted_ids - dest * n_local).contiguous(), recv, send, group=shard.group)
    if rows.shape[0]:
        out = local(experts, rows, got_ids.unsqueeze(-1), rows.new_ones((rows.shape[0], 1)))
    else:  # no row for this rank's experts: still joins the exchanges, forward and backward
        # (through the attributes: under a parameter LoRA they are the weights with the adapters' update folded in)
        ties = [getattr(experts, n) for n in SLICED if hasattr(experts, n) and getattr(experts, n) is not None]
        tie = sum(t.reshape(-1)[:1].sum() for t in ties if t.requires_grad)
        out = rows * 0 + (tie * 0 if torch.is_tensor(tie) else 0)
    back = _AllToAll.apply(out, recv, send, shard.group)
    weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return weighted[inverse].view(T, k, hidden.shape[-1]).sum(dim=1).to(hidden.dtype)
