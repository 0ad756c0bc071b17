"""Qwen2.5-VL's matrix products per layer (``Family.matmuls``, for analytic FLOPs, TFLOP/s and MFU): the
native-resolution ViT runs on each micro-batch's own patches, its attention within each frame (the
full-attention blocks) or within each window of ``window_size`` pixels (the others), so its cost is
read from the micro-batch's image grids (``micro_batch``: host values, no device read), not from a
fixed image size."""
from __future__ import annotations

import warnings

import torch

from mmpipe.families.chat.masks import mask_kind, sample_spans
from mmpipe.families.products import (
    DECODER_BLOCK,
    Matmul,
    MicroBatch,
    attention_products,
    decoder_products,
    span_attention_products,
)

VISION_BLOCK = {"qkv": "attn.qkv", "o": "attn.proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                "down": "mlp.down_proj"}


def _spans(n: int, size: int) -> list:
    return [min(size, n - i) for i in range(0, n, size)]


def grid_shape(grids: list, merge: int, window: int) -> tuple:
    """(patches, full-attention pairs, window-attention pairs) of images with patch grids ``grids``
    ((t, h, w) each), windows of ``window`` merged tokens a side (transformers'
    ``get_vision_window_index``: the last window of a row or column holds what is left)."""
    patches = full = windowed = 0
    for t, h, w in grids:
        patches += t * h * w
        full += t * (h * w) ** 2
        rows, cols = _spans(h // merge, window), _spans(w // merge, window)
        windowed += t * merge ** 4 * sum(r * r for r in rows) * sum(c * c for c in cols)
    return patches, full, windowed


def micro_batch(family, batch: dict, mb: MicroBatch) -> MicroBatch:
    """``mb`` with the patches and attention pairs of the batch's ``image_grid_thw`` (its host values:
    a loader's batch, or a meta grid carrying them)."""
    grid = batch.get("image_grid_thw")
    if not torch.is_tensor(grid) or grid.shape[0] == 0:
        return mb._replace(images=0)
    values = getattr(grid, "_mmpipe_grid", grid)
    if values.device.type != "cpu":  # a device grid: reading it would wait for the device
        warnings.warn("qwen_vl FLOPs: a micro-batch's image_grid_thw is on the device without its host values: its "
                      "ViT is priced as one merge unit (tflops / mfu low); count FLOPs on the loader's host batch")
        return mb._replace(images=int(grid.shape[0]))
    v = family.vision_cfg
    merge = v.spatial_merge_size
    window = getattr(v, "window_size", None)  # (Qwen3.5's ViT has no windows: every block within each frame)
    patches, full, windowed = grid_shape(values.tolist(), merge, window // merge // v.patch_size if window else 1)
    return mb._replace(images=int(grid.shape[0]), patches=patches, full_pairs=full,
                       window_pairs=windowed if window else 0)


def matmuls(family, name: str, mb: MicroBatch) -> list:
    """The products of layer ``name`` on ``mb``: the ViT's on its patches (a micro-batch without images:
    on the one merge unit its blocks then run on), the merger's on the merged tokens, the decoder's and
    the LM head's on every (padded) token position."""
    v, t = family.vision_cfg, family.text_cfg
    merge = v.spatial_merge_size
    patches, full, windowed = ((mb.patches, mb.full_pairs, mb.window_pairs) if mb.patches
                               else grid_shape([(1, merge, merge)], merge, 1))
    width, heads = v.hidden_size, v.num_heads
    if name == "vision.embed":  # (no images: the blocks start from the merge unit's zero rows)
        if not mb.patches:
            return []
        kernel = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
        return [Matmul(patches, kernel, width, "proj", 0)]
    if name.startswith("vision.blocks."):
        pairs = full if int(name.rsplit(".", 1)[1]) in (v.fullatt_block_indexes or ()) else windowed
        return ([Matmul(patches, width, 3 * width, VISION_BLOCK["qkv"], 1)]
                + span_attention_products(pairs, heads, width // heads)
                + [Matmul(patches, width, width, VISION_BLOCK["o"])]
                + [Matmul(patches, width, v.intermediate_size, VISION_BLOCK[k]) for k in ("gate", "up")]
                + [Matmul(patches, v.intermediate_size, width, VISION_BLOCK["down"], recomputed=False)])
    if name == "merger":
        tokens, wide = patches // merge ** 2, width * merge ** 2
        return [Matmul(tokens, wide, wide, "mlp.0", 1), Matmul(tokens, wide, v.out_hidden_size, "mlp.2", recomputed=False)]
    return decoder_products(name, mb, t)


# ---- Qwen3.5 ----------------------------------------------------------------------------------
QWEN3_5_VISION_BLOCK = {"qkv": "attn.qkv", "o": "attn.proj", "up": "mlp.linear_fc1", "down": "mlp.linear_fc2"}
DECODER_MLP = {k: DECODER_BLOCK[k] for k in ("gate", "up", "down")}
GATED_ATTENTION = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj"}


# the gated delta rule's chunk (transformers' torch_chunk_gated_delta_rule and flash-linear-attention: 64)
DELTA_RULE_CHUNK = 64


def _chunked(n: int) -> int:
    return -(-n // DELTA_RULE_CHUNK) * DELTA_RULE_CHUNK


def recurrent_shape(batch: dict, mb: MicroBatch) -> MicroBatch:
    """``mb`` with the runs a linear-attention block makes on a packed row (``qwen3_5_model``: sample by sample,
    its padding not at all); other rows run whole (``recurrent_spans`` left empty)."""
    mask = batch.get("attention_mask")
    if torch.is_tensor(mask) and not mask.is_meta and mask.device.type == "cpu" and mask.dim() == 2 \
            and mask_kind(mask) == "packed":
        return mb._replace(recurrent_spans=tuple(end - start for row in mask.tolist() for start, end in sample_spans(row)))
    return mb


def gated_delta_products(spans: list, t) -> list:
    """A GatedDeltaNet block's products on runs of ``spans`` positions each (transformers' ``Qwen3_5GatedDeltaNet``,
    once per run): the four input projections (q, k, v together; the output gate z; the per-head b and a), the
    causal depthwise conv (kernel x channels per output position: a run's length + kernel - 1, as a zero-padded
    convolution computes it), the gated delta rule in its chunked form (``delta_rule_products``) and the output
    projection."""
    width, nk, nv = t.hidden_size, t.linear_num_key_heads, t.linear_num_value_heads
    key, value = nk * t.linear_key_head_dim, nv * t.linear_value_head_dim
    conv = 2 * key + value
    kernel = t.linear_conv_kernel_dim
    tokens = sum(spans)
    conv_out = tokens + len(spans) * (kernel - 1)
    return [Matmul(tokens, width, conv, "linear_attn.in_proj_qkv", 1), Matmul(tokens, width, value, "linear_attn.in_proj_z", 1),
            Matmul(tokens, width, nv, "linear_attn.in_proj_b", 1), Matmul(tokens, width, nv, "linear_attn.in_proj_a", 1),
            Matmul(conv_out * conv, kernel, 1, "linear_attn.conv1d")]\
        + delta_rule_products(spans, nv, t.linear_key_head_dim, t.linear_value_head_dim)\
        + [Matmul(tokens, value, width, "linear_attn.out_proj")]


def delta_rule_products(spans: list, heads: int, dk: int, dv: int) -> list:
    """The gated delta rule's products in its chunked form, per value head, on runs of ``spans`` positions, each
    padded to the chunk C (transformers' torch path; flash-linear-attention's chunk kernel computes the same
    products): within each chunk k_beta·k^T and q·k^T (C x d_k x C) and the intra-chunk attention times the new
    values (C x C x d_v); across chunks the state (d_k x d_v) read by the decayed keys and by the queries, and its
    update. Their backward as autograd runs it: a run's first chunk reads the zero state (no gradient for it: one
    product each, not two) and its last chunk's update makes the final state nobody reads (no backward); each of
    the two unit-triangular solves (no matrix product forward) takes one product for its matrix's gradient."""
    c = DELTA_RULE_CHUNK
    positions = sum(map(_chunked, spans)) * heads
    first = len(spans) * c * heads  # each run's first chunk (and its last: one chunk is both)
    rest = positions - first
    out = [Matmul(positions, dk, c), Matmul(positions, dk, c), Matmul(positions, c, dv)]
    out += [Matmul(first, dk, dv, grads=1), Matmul(first, dk, dv, grads=1), Matmul(first, dk, dv, grads=0)]
    if rest:
        out += [Matmul(rest, dk, dv) for _ in range(3)]
    out += [Matmul(positions, c, dv, grads=1, forward=False), Matmul(positions, c, dk, grads=1, forward=False)]
    return out


def qwen3_5_matmuls(family, name: str, mb: MicroBatch) -> list:
    """The products of a Qwen3.5 layer on ``mb``: the ViT's on its patches (full attention within each frame in
    every block, a non-gated MLP), the merger's, and the hybrid decoder's on every (padded) token position: a
    linear-attention block's (``gated_delta_products``) or a gated full-attention block's (q_proj gives the
    queries and their output gate: twice the heads' width; attention as sdpa computes it over the padded rows)
    and its gated MLP; the LM head."""
    v, t = family.vision_cfg, family.text_cfg
    merge = v.spatial_merge_size
    patches, full = (mb.patches, mb.full_pairs) if mb.patches else grid_shape([(1, merge, merge)], merge, 1)[:2]
    width, heads = v.hidden_size, v.num_heads
    if name == "vision.embed":
        if not mb.patches:
            return []
        kernel = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
        return [Matmul(patches, kernel, width, "patch_embed.proj", 0)]
    if name.startswith("vision.blocks."):
        b = QWEN3_5_VISION_BLOCK
        return ([Matmul(patches, width, 3 * width, b["qkv"], 1)] + span_attention_products(full, heads, width // heads)
                + [Matmul(patches, width, width, b["o"]), Matmul(patches, width, v.intermediate_size, b["up"], 1),
                   Matmul(patches, v.intermediate_size, width, b["down"], recomputed=False)])
    if name == "merger":
        tokens, wide = patches // merge ** 2, width * merge ** 2
        return [Matmul(tokens, wide, wide, "linear_fc1", 1), Matmul(tokens, wide, v.out_hidden_size, "linear_fc2", recomputed=False)]
    tokens = mb.rows * mb.seq_len
    if name.startswith("llm.blocks."):
        # (the MLP reads the block's residual after its own attention: depth 2, a gradient whenever the block trains)
        mlp = dense_mlp_products(tokens, t) if getattr(t, "intermediate_size", None) else []  # (MoE: the experts')
        if t.layer_types[int(name.rsplit(".", 1)[1])] == "linear_attention":
            return gated_delta_products(list(mb.recurrent_spans) or [mb.seq_len] * mb.rows, t) + mlp
        hd, kv = t.head_dim, t.num_key_value_heads * t.head_dim
        return ([Matmul(tokens, t.hidden_size, 2 * t.num_attention_heads * hd, GATED_ATTENTION["q"], 1),
                 Matmul(tokens, t.hidden_size, kv, GATED_ATTENTION["k"], 1),
                 Matmul(tokens, t.hidden_size, kv, GATED_ATTENTION["v"], 1)]
                + attention_products(mb.rows, mb.seq_len, t.num_attention_heads, hd)
                + [Matmul(tokens, t.num_attention_heads * hd, t.hidden_size, GATED_ATTENTION["o"])] + mlp)
    return decoder_products(name, mb, t)


def dense_mlp_products(tokens: int, t) -> list:
    """A decoder block's gated MLP on ``tokens`` positions."""
    mlp = [Matmul(tokens, t.hidden_size, t.intermediate_size, DECODER_MLP[k]) for k in ("gate", "up")]
    return mlp + [Matmul(tokens, t.intermediate_size, t.hidden_size, DECODER_MLP["down"], recomputed=False)]


def expert_products(tokens: int, t) -> list:
    """A sparse MoE block's products on ``tokens`` positions, active parameters only: the router (H x E), each
    token's ``num_experts_per_tok`` experts (gate and up fused, then down: transformers' grouped products), and
    a shared expert with its sigmoid gate where the block has one (Qwen3.5-MoE)."""
    routed, width, inter = tokens * t.num_experts_per_tok, t.hidden_size, t.moe_intermediate_size
    out = [Matmul(tokens, width, t.num_experts, "mlp.gate", 1),
           Matmul(routed, width, 2 * inter, "mlp.experts.gate_up_proj", 1),
           Matmul(routed, inter, width, "mlp.experts.down_proj")]
    shared = getattr(t, "shared_expert_intermediate_size", None)
    if shared:
        out += [Matmul(tokens, width, shared, "mlp.shared_expert.gate_proj", 1),
                Matmul(tokens, width, shared, "mlp.shared_expert.up_proj", 1),
                Matmul(tokens, shared, width, "mlp.shared_expert.down_proj"),
                Matmul(tokens, width, 1, "mlp.shared_expert_gate", 1)]
    return out


def qwen3_vl_matmuls(family, name: str, mb: MicroBatch) -> list:
    """The products of a Qwen3-VL layer on ``mb``: the ViT and merger are Qwen3.5's (``qwen3_5_matmuls``), each
    DeepStack merger the merger's products on the same merged tokens (its norm after the shuffle is no product),
    the Qwen3 decoder a plain decoder's (q/k norm and DeepStack's addition are no products)."""
    if name.startswith("deepstack."):
        return qwen3_5_matmuls(family, "merger", mb)
    if name.startswith("vision.") or name == "merger":
        return qwen3_5_matmuls(family, name, mb)
    return decoder_products(name, mb, family.text_cfg)
