"""Expert parallelism: the token exchange on two gloo ranks equals transformers' experts on one (forward, the tokens'
gradients, each rank's experts' gradients), a rank that receives no token included."""
from __future__ import annotations

import os

import torch


def _experts(seed: int):
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    from mmpipe.families.qwen_vl.experts import use_experts
    cfg = Qwen3_5MoeTextConfig(hidden_size=16, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2)
    use_experts(cfg)
    torch.manual_seed(seed)
    m = Qwen3_5MoeExperts(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m


def _routing(rank: int, case: str):
    """(hidden [T, H], top-k ids [T, 2], weights [T, 2]) of a rank; ``skewed``: every token of both ranks goes to
    experts 0-3 (rank 0's half): rank 1 receives no row."""
    g = torch.Generator().manual_seed(10 + rank)
    T = 5 + 2 * rank
    hidden = torch.randn(T, 16, generator=g)
    hi = 4 if case == "skewed" else 8
    ids = torch.stack([torch.randperm(hi, generator=g)[:2] for _ in range(T)])
    w = torch.rand(T, 2, generator=g)
    return hidden, ids, w / w.sum(-1, keepdim=True)


def _rank(rank: int, world: int, init: str, out: str, case: str):
    import torch.distributed as dist

    from mmpipe.families.expert_dispatch import ExpertShard, shard_experts
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    m = _experts(seed=3)
    shard = ExpertShard(dist.new_group([0, 1]), rank, 2, "ep_size_2")
    assert shard_experts(m, shard) == 1 and m.num_experts == 4 and m.gate_up_proj.shape[0] == 4
    hidden, ids, w = _routing(rank, case)
    hidden.requires_grad_(True)
    w.requires_grad_(True)
    y = m(hidden, ids, w)
    (y * torch.arange(y.numel()).view_as(y).float().sin()).sum().backward()
    torch.save({"y": y.detach(), "dh": hidden.grad, "dw": w.grad, "gate_up": m.gate_up_proj.grad,
                "down": m.down_proj.grad}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_two_rank_dispatch_equals_the_one_rank_experts(tmp_path):
    import torch.multiprocessing as mp
    for case in ("spread", "skewed"):
        out = tmp_path / case
        out.mkdir()
        mp.spawn(_rank, args=(2, f"file://{tmp_path}/store_{case}", str(out), case), nprocs=2, join=True)
        ref = _experts(seed=3)
        got = [torch.load(out / f"rank{r}.pt") for r in range(2)]
        for r in range(2):
            hidden, ids, w = _routing(r, case)
            hidden.requires_grad_(True)
            w.requires_grad_(True)
            y = ref(hidden, ids, w)
            (y * torch.arange(y.numel()).view_as(y).float().sin()).sum().backward()
            torch.testing.assert_close(got[r]["y"], y.detach(), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got[r]["dh"], hidden.grad, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got[r]["dw"], w.grad, rtol=1e-6, atol=1e-6)
        # each rank's experts: the gradient over both ranks' tokens (the reference accumulated both backwards)
        for key, name in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
            full = getattr(ref, name).grad
            torch.testing.assert_close(torch.cat([got[0][key], got[1][key]]), full, rtol=1e-5, atol=1e-6)
        if case == "skewed":
            assert float(got[1]["gate_up"].abs().sum()) == 0.0 and float(got[0]["gate_up"].abs().sum()) > 0
