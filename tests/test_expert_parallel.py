"""Expert parallelism's parts: the token exchange on two gloo ranks equals transformers' experts on one (forward, the
tokens' gradients, each rank's experts' gradients), a rank that receives no token included; the memory model's
expert slices; its config mistakes in one line. Its layouts train in ``tests/test_qwen_moe.py``."""
from __future__ import annotations

import os

import pytest
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


def test_the_memory_model_holds_a_slice_of_the_experts_per_rank():
    """A layer of 1000 parameters, 800 of them routed experts, over four data-parallel ranks: with EP2 a rank holds
    half the experts' weights and gradients; ZeRO partitions their optimizer state over the two ranks holding the
    same experts (as much per rank as all experts over four), ZeRO-2 their gradients too; without ZeRO half."""
    from mmpipe.planning.memory import RunShape, optimizer_bytes, stage_breakdown
    from mmpipe.planning.place import layer_costs
    costs = layer_costs({"layers": [dict(name="moe", fwd_ms=1.0, bwd_ms=1.0, act_bytes=0, out_bytes=0, param_bytes=0,
                                         params=1000, trainable=1000, experts=800, experts_trainable=800)]})
    for precision, zero in (("fp32", 0), ("fp32", 1), ("bf16", 0), ("bf16", 1), ("fp32", 2)):
        one, two = (stage_breakdown(costs, [0, 1], 1, precision, zero, 4, RunShape(expert_parallel=e))[0]
                    for e in (1, 2))
        w = 4 if precision == "fp32" else 2
        assert one.weights - two.weights == 400 * w
        assert one.grads - two.grads == (400 * w if zero < 2 else 800 * w / 4 - 400 * w / 2)
        if zero >= 1:
            assert two.optimizer == pytest.approx(one.optimizer)
        else:
            assert one.optimizer - two.optimizer == pytest.approx(optimizer_bytes(precision, 0, 1, False, 400))


def test_expert_parallel_mistakes_are_one_line(tmp_path):
    """A family without experts, ZeRO-3, an E that does not divide the data-parallel degree or the experts: one line
    naming the key and the fix."""
    from types import SimpleNamespace

    from mmpipe.config.schema import load_config
    from mmpipe.errors import ConfigError
    from mmpipe.parallel.topology import Topology
    from mmpipe.train.setup import _experts_split
    from helpers import TINY_CONFIGS
    tiny, moe = TINY_CONFIGS["qwen3_5_moe"], ["parallel.expert_parallel=2"]
    with pytest.raises(ConfigError, match=r"parallel.expert_parallel=2: model.type=clip has no routed experts"):
        load_config(None, ["model.type=clip", "parallel.expert_parallel=2"])
    with pytest.raises(ConfigError, match=r"expert_parallel=2 with parallel.zero_stage=3"):
        load_config(tiny, moe + ["parallel.zero_stage=3"])
    with pytest.raises(ConfigError, match=r"expert_parallel=4 does not divide the data-parallel degree 2"):
        Topology(world_size=4, pipeline_stages=2, micro_batch_size=1, batch_size=8, expert_parallel=4)
    assert Topology(world_size=8, pipeline_stages=2, micro_batch_size=1, batch_size=8,
                    expert_parallel=2).expert_rank(5) == 1
    cfg = load_config(tiny, moe)
    with pytest.raises(ConfigError, match=r"expert_parallel=2 does not divide model.llm.num_experts=7"):
        _experts_split(cfg, SimpleNamespace(num_experts=7))
    assert _experts_split(cfg, SimpleNamespace(num_experts=8))[0] is cfg


def test_a_moe_layer_is_priced_with_its_token_exchanges():
    """With EP the cut and the order see each MoE layer's four all-to-alls of its routed rows (two in its forward,
    two in its backward: the split backward's input pass); a dense layer and EP1 as profiled."""
    from mmpipe.planning.place import with_exchanges
    layer = dict(name="moe", fwd_ms=1.0, bwd_ms=2.0, bwd_in_ms=1.5, bwd_w_ms=0.5, routed_bytes=1000)
    prof = {"layers": [layer, dict(name="dense", fwd_ms=1.0, bwd_ms=2.0)],
            "comm": {"latency_s": 1e-3, "s_per_byte": 1e-6}}
    assert with_exchanges(prof, 1)["layers"] == prof["layers"] and with_exchanges(prof, 1)["expert_parallel"] == 1
    two = with_exchanges(prof, 2)
    one_exchange_ms = 1e3 * (1e-3 + 1e-6 * 1000 / 2)  # latency + the half of the rows that leaves the rank
    moe, dense = two["layers"]
    assert moe["fwd_ms"] == pytest.approx(1.0 + 2 * one_exchange_ms)
    assert moe["bwd_ms"] == pytest.approx(2.0 + 2 * one_exchange_ms)
    assert moe["bwd_in_ms"] == pytest.approx(1.5 + 2 * one_exchange_ms) and moe["bwd_w_ms"] == 0.5
    assert dense == prof["layers"][1] and two["expert_parallel"] == 2


def _lora_block(targets: tuple, seed: int = 0):
    """A Qwen3.5-MoE sparse block (4 experts) with peft's parameter LoRA on ``targets`` (and all-linear), its factors
    random (B too: a non-zero update)."""
    import contextlib

    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    from mmpipe.families.lora import LoraSpec, inject
    from mmpipe.families.qwen_vl.experts import use_experts
    cfg = Qwen3_5MoeTextConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                               shared_expert_intermediate_size=8)
    use_experts(cfg)
    torch.manual_seed(seed)
    block = torch.nn.Module()
    block.mlp = Qwen3_5MoeSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    spec = LoraSpec(2, 4, 0.0, ("all-linear",), frozenset(), targets)
    block = inject(block, spec, contextlib.nullcontext())
    with torch.no_grad():
        for n, p in block.named_parameters():
            if ".lora_" in n:
                p.normal_(std=0.2)
    return block, spec, cfg


@pytest.mark.parametrize("targets", [("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
                                     ("experts.gate_up_proj", "mlp.experts.down_proj"), ("experts.gate_up_proj",),
                                     ("mlp.experts.down_proj",)])
def test_a_parameter_lora_merges_as_peft_folds_it(targets):
    """``merged`` folds each fused-experts adapter into its own parameter whatever the targets' prefixes (peft nests
    one wrapper per parameter by the module's order, not the targets'): the merged block gives the adapted block's
    output; the adapters are told from the Linear ones' (``peft_targets``)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    from mmpipe.families.lora import merged, parameter_adapter
    block, spec, cfg = _lora_block(targets)
    x = torch.randn(1, 5, 16)
    plain = torch.nn.Module()
    plain.mlp = Qwen3_5MoeSparseMoeBlock(cfg)
    plain.load_state_dict(merged(block.state_dict(), spec))
    out = lambda m: (lambda y: y[0] if isinstance(y, tuple) else y)(m.mlp(x))  # noqa: E731
    torch.testing.assert_close(out(plain), out(block), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out(plain), out(_lora_block(())[0]), atol=1e-4)  # (the update is not nothing)
    kinds = {k.split(".lora_")[0]: parameter_adapter(k, spec) for k in block.state_dict() if ".lora_" in k}
    assert {k for k, v in kinds.items() if v} == {"mlp.experts" + ".base_layer" * d for d in range(len(targets))}
    assert kinds["mlp.shared_expert.up_proj"] is False


def test_a_parameter_loras_adapters_split_over_expert_ranks():
    """Under expert parallelism each of two ranks keeps its experts' rank-r factors (``lora_A``'s rows, ``lora_B``'s
    interleaved columns): its block's update is the full update's slice for its experts; ``mine`` / ``whole_shape``
    say where a checkpoint's tensor goes."""
    from mmpipe.families.expert_dispatch import ExpertShard, mine, shard_experts, whole_shape
    from mmpipe.families.lora import expert_delta
    targets = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    full, _, _ = _lora_block(targets)
    wrapper = full.mlp.experts  # (down_proj's, outermost)
    A, B = wrapper.lora_A["default"].weight.detach().clone(), wrapper.lora_B["default"].weight.detach().clone()
    want = expert_delta(A, B, 4, 1.0)
    for rank in range(2):
        block, _, _ = _lora_block(targets)
        shard = ExpertShard(None, rank, 2, "ep_size_2")
        assert shard_experts(block, shard) == 1 and block.mlp.experts.num_experts == 2
        a, b = block.mlp.experts.lora_A["default"].weight, block.mlp.experts.lora_B["default"].weight
        torch.testing.assert_close(expert_delta(a, b, 2, 1.0), want[2 * rank:2 * rank + 2])
        torch.testing.assert_close(mine(b, B), b.detach()) and torch.testing.assert_close(mine(a, A), a.detach())
        assert whole_shape(a) == tuple(A.shape) and whole_shape(b) == tuple(B.shape)
        assert block.mlp.experts.base_layer.base_layer.gate_up_proj.shape[0] == 2
