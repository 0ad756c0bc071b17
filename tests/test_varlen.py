"""``model.attention: varlen``: attention by span boundaries (``cu_seqlens``) instead of a dense mask. Its CPU
path (one sdpa call per span) is the reference the GPU kernels are held to; here it is held to the mask path:
equal outputs on every real token and equal gradients, with grouped-query heads and padding. The families'
packed rows under it: ``test_packing``, ``test_qwen2_5_vl``, ``test_qwen3_5`` (varlen = unpacked)."""
from __future__ import annotations

import pytest
import torch
from helpers import TINY_VLM

import mmpipe
from mmpipe.families.chat.masks import attention_inputs, mask_kind, packed_mask
from mmpipe.families.towers import varlen


class _Attn(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def test_span_boundaries_of_packed_rows_flattened_row_after_row():
    seg = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [1, 1, 2, 3, 3, 3, 3]])
    cu, longest = varlen.spans_of(seg)
    assert cu.tolist() == [0, 3, 5, 7, 9, 10, 14] and cu.dtype == torch.int32
    assert longest == 4 and mask_kind(seg) == "packed"
    # a row ending in a sample and the next row starting with the same id are two spans, not one
    cu, _ = varlen.spans_of(torch.tensor([[1, 1, 2, 2], [2, 2, 1, 1]]))
    assert cu.tolist() == [0, 2, 4, 6, 8]


def test_varlen_attention_equals_the_block_diagonal_mask_with_grouped_heads_and_padding():
    torch.manual_seed(0)
    seg = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 2, 2, 2, 2]])
    B, T, D = 2, seg.shape[1], 8
    q = torch.randn(B, 4, T, D, requires_grad=True)
    k, v = (torch.randn(B, 2, T, D, requires_grad=True) for _ in range(2))
    upstream = torch.randn(B, T, 4, D)
    real = (seg > 0)[..., None, None]

    def run(fn):
        for t in (q, k, v):
            t.grad = None
        out = fn()
        (out * upstream * real).sum().backward()
        return out, [t.grad.clone() for t in (q, k, v)]

    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    _, mask, spans = attention_inputs(seg, q.dtype, varlen.VARLEN)
    assert mask is None and spans["max_length_q"] == 6
    want, gw = run(lambda: sdpa_attention_forward(_Attn(), q, k, v, packed_mask(seg), scaling=0.3)[0])
    got, gg = run(lambda: varlen.varlen_attention(_Attn(), q, k, v, None, scaling=0.3, **spans)[0])
    torch.testing.assert_close(got * real, want * real, rtol=1e-5, atol=1e-6)
    for a, b in zip(gg, gw):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the spans matter: one span per row (samples seeing each other) is not the mask's answer
    whole = {**spans, "cu_seq_lens_q": torch.tensor([0, T, 2 * T], dtype=torch.int32), "max_length_q": T}
    wrong = varlen.varlen_attention(_Attn(), q, k, v, None, scaling=0.3, **whole)[0]
    assert not torch.allclose(wrong * real, want * real, atol=1e-3)
    assert varlen.kernel_for(q) == "spans"  # the CPU path: one sdpa call per span
    # without boundaries (rows not packed, transformers' own model in generation) it is sdpa, unchanged
    plain = varlen.varlen_attention(_Attn(), q, k, v, None, scaling=0.3)[0]
    torch.testing.assert_close(plain, sdpa_attention_forward(_Attn(), q, k, v, None, scaling=0.3)[0])


def test_an_unknown_attention_is_one_line_naming_the_key():
    with pytest.raises(mmpipe.errors.ConfigError, match=r"model.attention='flash' is not one of sdpa, varlen"):
        mmpipe.load_config(TINY_VLM, ["model.attention=flash"])


def test_the_attention_bench_holds_each_kernel_it_can_run_to_the_mask():
    """``mmpipe bench attention`` on this CPU: the mask and the per-span path run forward and backward and agree
    (fp32); the CUDA kernels say why they did not run."""
    from mmpipe.bench.attention import measure, packed_rows
    seg = packed_rows(2, 256, 40, 120)
    assert int(seg.max()) >= 2 and (seg == 0).any()  # several samples a row, and padding
    res = {r["kernel"]: r for r in measure("tiny", 2, 256, (40, 120), torch.float32, torch.device("cpu"), reps=1)}
    assert res["mask"]["max_rel_err"] == 0 and res["spans"]["max_rel_err"] < 1e-5 and res["spans"]["ms"] > 0
    assert all("CUDA only" in res[k]["skipped"] for k in ("torch_varlen", "flash_attn", "flex"))


def test_the_memory_plan_of_varlen_counts_no_mask():
    """Sized on the meta device, a packed run's decoder blocks keep the (B, 1, T, T) mask under sdpa (saved for
    the backward) and nothing of the kind under varlen."""
    from mmpipe.planning.measure import meta_profile
    from mmpipe.planning.offline import resolve_for_plan
    from mmpipe.planning.place import layer_costs
    blocks = {}
    for attention in ("sdpa", "varlen"):
        cfg, family = resolve_for_plan(mmpipe.load_config(TINY_VLM, ["data.packing=true", "data.max_length=96",
                                                                     f"model.attention={attention}"]))
        costs = layer_costs(meta_profile(cfg, family, 2))
        blocks[attention] = [c.act_bytes + c.workspace for c in costs if c.name.startswith("llm.blocks.")]
    assert blocks["sdpa"] and all(v < s for v, s in zip(blocks["varlen"], blocks["sdpa"])), blocks


def test_a_decoder_with_attention_dropout_is_refused_under_varlen_at_setup(tmp_path):
    """A directory whose decoder has attention dropout trains under sdpa; under varlen it is one line when the model
    is built, not a traceback at the first micro-batch that holds a packed row."""
    from helpers import TINY_CONFIGS

    from mmpipe.families.qwen_vl.tiny import write_tiny_qwen2_5_vl
    d = write_tiny_qwen2_5_vl(str(tmp_path / "q25"), seed=1, text={"attention_dropout": 0.1})
    sets = [f"model.pretrained={d}", "model.llm.max_position_embeddings=null", "data.packing=true"]
    mmpipe.build_model(mmpipe.load_config(TINY_CONFIGS["qwen2_5_vl"], sets))
    with pytest.raises(mmpipe.errors.ConfigError, match=r"^model.attention=varlen: the decoder's attention_dropout "
                       r"is 0.1 \(model.pretrained's config.json\).*set it to 0 there or use model.attention=sdpa$"):
        mmpipe.build_model(mmpipe.load_config(TINY_CONFIGS["qwen2_5_vl"], sets + ["model.attention=varlen"]))
