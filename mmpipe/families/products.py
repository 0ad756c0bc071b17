"""The arithmetic a family describes (``Family.matmuls``): the shape of a micro-batch, one matrix
product of a layer's forward, and the products of the transformer blocks the towers share.
``mmpipe.planning.flops`` turns them into FLOPs per layer, step and stage."""
from __future__ import annotations

from typing import NamedTuple, Optional


class MicroBatch(NamedTuple):
    """A micro-batch's real shape, read from its host tensors' shapes (no values): ``rows``
    (samples, or packed rows), ``seq_len`` (tokens per row as the model computes them: the
    micro-batch's own padded length, not ``data.max_length``), ``images`` (images it holds; image
    sizes are the model's), ``negatives`` (rows a contrastive loss scores each row against: the
    global batch under a step loss; 0 = this micro-batch's rows); for a native-resolution tower the
    patch count and attention pairs its image grids give (``patches``, ``full_pairs``, ``window_pairs``)."""
    rows: int
    seq_len: int
    images: int = 0
    negatives: int = 0
    # native resolution (images of their own sizes): the ViT's patch rows, and the (query, key) pairs its
    # attention spans: within each frame (full attention) and within each window (windowed blocks)
    patches: int = 0
    full_pairs: int = 0
    window_pairs: int = 0
    # a recurrent (linear-attention) layer run sample by sample on packed rows: the length of each run
    # (empty: every row whole)
    recurrent_spans: tuple = ()


class Matmul(NamedTuple):
    """One matrix product of a layer's forward, (m x k) @ (k x n): 2·m·k·n FLOPs. ``weight``: the
    module path, inside the layer, of the Linear or convolution whose weight is the (k x n) operand
    ("" for a layer that is itself a Linear; the parameter's own path when it is no module's ``weight``: an
    ``nn.MultiheadAttention``'s ``in_proj_weight``); None for a product of two activations (attention's
    QK^T and AV, contrastive logits). ``depth``: what the product reads: 0 the layer's input as it
    came, 1 the input through a norm (whose weights may train), 2 the output of another product.
    ``recomputed``: activation checkpointing runs it again in backward; False for a layer's last
    product whose output nothing keeps (a block's last linear before its residual add, a layer that
    is one Linear): torch's recompute stops at the last tensor backward needs. ``rescored``: the
    backward runs it again (attention's QK^T: sdpa's fused kernels keep no scores). For a product of two
    activations, ``grads``: the products its backward runs (None: one per operand, 2; fewer where an operand
    is a constant or its result is dropped), and ``forward=False`` for a backward-only product (a triangular
    solve's gradient of its matrix: the solve itself is no matrix product)."""
    m: int
    k: int
    n: int
    weight: Optional[str] = None
    depth: int = 2
    recomputed: bool = True
    rescored: bool = False
    grads: Optional[int] = None
    forward: bool = True


# module paths of the blocks' products (``block_products``' names)
CLIP_BLOCK = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.out_proj",
              "up": "mlp.fc1", "down": "mlp.fc2"}
BERT_BLOCK = {"q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
              "o": "attention.output.dense", "up": "intermediate.dense", "down": "output.dense"}
DECODER_BLOCK = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                 "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def span_attention_products(pairs: int, heads: int, head_dim: int) -> list:
    """QK^T and AV over variable-length spans (each query attends to its own span's keys only: a
    varlen kernel, or one sdpa call per span) holding ``pairs`` (query, key) pairs in all."""
    return [Matmul(heads * pairs, head_dim, 1, rescored=True), Matmul(heads * pairs, 1, head_dim)]


def attention_products(rows: int, seq: int, heads: int, head_dim: int) -> list:
    """QK^T and AV of ``heads`` query heads over ``rows`` rows of ``seq`` tokens, as sdpa computes
    them: every (query, key) pair of the padded rows (a mask hides pairs, it does not skip them;
    grouped key/value heads are broadcast to the query heads); their backward computes QK^T again."""
    m = rows * heads * seq
    return [Matmul(m, head_dim, seq, rescored=True), Matmul(m, seq, head_dim)]


def block_products(tokens: int, rows: int, seq: int, names: dict, width: int, inter: int, heads: int,
                   kv_heads: int = None, post_norm: bool = False, head_dim: int = None) -> list:
    """A transformer block's products on ``rows`` rows of ``seq`` tokens (``tokens`` = rows x seq):
    q/k/v projections (``kv_heads`` grouped key/value heads), attention, the output projection and
    the MLP; ``names``: the block's module paths under the keys q, k, v, o, and up, down (plus gate
    for a gated MLP); ``post_norm``: the block norms after its residual adds (BERT: q/k/v read its
    input, and the norm keeps the last linear's output), else before its products."""
    qkv_depth = 0 if post_norm else 1
    head_dim = head_dim or width // heads
    q, kv = heads * head_dim, (kv_heads or heads) * head_dim
    out = [Matmul(tokens, width, q, names["q"], qkv_depth), Matmul(tokens, width, kv, names["k"], qkv_depth),
           Matmul(tokens, width, kv, names["v"], qkv_depth)]
    out += attention_products(rows, seq, heads, head_dim)
    out.append(Matmul(tokens, q, width, names["o"]))
    out += [Matmul(tokens, width, inter, names[k]) for k in ("gate", "up") if k in names]
    out.append(Matmul(tokens, inter, width, names["down"], recomputed=post_norm))
    return out


def decoder_products(name: str, mb: MicroBatch, t) -> list:
    """A chat decoder's layers on every (padded) token position of ``mb``, from its transformers text
    config ``t``: ``llm.blocks.i`` (a decoder block of Llama's / Qwen2's module names, grouped key/value
    heads), ``llm.head`` (its norm, then the LM head), ``llm.embed`` (none: a lookup and a scatter)."""
    tokens = mb.rows * mb.seq_len
    if name.startswith("llm.blocks."):
        return block_products(tokens, mb.rows, mb.seq_len, DECODER_BLOCK, t.hidden_size, t.intermediate_size,
                              t.num_attention_heads, t.num_key_value_heads, head_dim=getattr(t, "head_dim", None))
    if name == "llm.head":
        return [Matmul(tokens, t.hidden_size, t.vocab_size, "lm_head", 1, recomputed=False)]
    return []
