"""SigLIP's towers as named parts, with transformers' modules and arithmetic (``SiglipModel``; the
siglip family's towers, and a LLaVA-style VLM's image tower):

    vision: embed (patches + positions, no class token), blocks.i, head (post layer norm, then the
            attention-pooling head: a learned probe attends over the patches)
    text:   embed (tokens + positions), blocks.i (bidirectional: padding is attended, as SigLIP's
            processor pads to the tower's length and passes no mask), head (final layer norm, the
            last position, a linear head)
"""
from __future__ import annotations

from torch import nn

from mmpipe.families.products import CLIP_BLOCK, Matmul, block_products
from mmpipe.families.towers.common import init_transformer_part, normalize_pixels, param_dtype

SIGLIP_MEAN = SIGLIP_STD = (0.5, 0.5, 0.5)
RULES = [("vision.embed.", "vision_model."), ("vision.blocks.", "vision_model.encoder.layers."),
         ("vision.head.", "vision_model."), ("text.embed.", "text_model."),
         ("text.blocks.", "text_model.encoder.layers."), ("text.head.", "text_model."),
         ("loss.logit_scale", "logit_scale"), ("loss.logit_bias", "logit_bias")]


class VisionEmbed(nn.Module):
    def __init__(self, c, mean, std):
        super().__init__()
        from transformers.models.siglip.modeling_siglip import SiglipVisionEmbeddings
        self.embeddings = SiglipVisionEmbeddings(c)
        self.mean, self.std = tuple(mean), tuple(std)

    def forward(self, pixel_values):
        # (patches come out transposed, and the blocks keep that layout: a stage boundary sends it)
        return self.embeddings(normalize_pixels(pixel_values, self.mean, self.std, param_dtype(self))).contiguous()


def block(c) -> nn.Module:
    from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer

    class SiglipBlock(SiglipEncoderLayer):
        def forward(self, hidden_states, attention_mask=None):  # SigLIP attends every position
            return super().forward(hidden_states, attention_mask=None)

    return SiglipBlock(c)


class VisionHead(nn.Module):
    def __init__(self, c):
        super().__init__()
        from transformers.models.siglip.modeling_siglip import SiglipMultiheadAttentionPoolingHead
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.head = SiglipMultiheadAttentionPoolingHead(c)

    def forward(self, hidden):
        # (the pooling head's batch-first attention leaves a transposed layout: a stage boundary sends it)
        return self.head(self.post_layernorm(hidden)).contiguous()


class TextEmbed(nn.Module):
    def __init__(self, c):
        super().__init__()
        from transformers.models.siglip.modeling_siglip import SiglipTextEmbeddings
        self.embeddings = SiglipTextEmbeddings(c)

    def forward(self, input_ids):
        return self.embeddings(input_ids=input_ids)


class TextHead(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.final_layer_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.head = nn.Linear(c.hidden_size, c.projection_size)

    def forward(self, hidden, input_ids, attention_mask):
        return self.head(self.final_layer_norm(hidden)[:, -1, :])


def build_part(tower: str, part: str, c, mean=SIGLIP_MEAN, std=SIGLIP_STD) -> nn.Module:
    if part == "embed":
        m = VisionEmbed(c, mean, std) if tower == "vision" else TextEmbed(c)
    elif part == "head":
        m = VisionHead(c) if tower == "vision" else TextHead(c)
    else:
        m = block(c)
    init_transformer_part(m)
    if tower == "vision" and part == "head":
        nn.init.normal_(m.head.probe, std=0.02)
    return m


def products(tower: str, part: str, c, rows: int, seq: int) -> list:
    """The products of a part on ``rows`` images or captions of ``seq`` tokens (patches)."""
    w, tokens = c.hidden_size, rows * seq
    if part == "embed":
        return ([Matmul(tokens, c.num_channels * c.patch_size ** 2, w, "embeddings.patch_embedding", 0)]
                if tower == "vision" else [])
    if part == "head":
        if tower == "text":
            return [Matmul(rows, w, c.projection_size, "head", 1, recomputed=False)]
        heads = c.num_attention_heads
        return ([Matmul(rows, w, w, "head.attention.in_proj_weight", 0),  # the probe's query
                 Matmul(tokens, w, 2 * w, "head.attention.in_proj_weight", 1)]  # keys and values of every patch
                + [Matmul(rows * heads, w // heads, seq, None), Matmul(rows * heads, seq, w // heads, None)]
                + [Matmul(rows, w, w, "head.attention.out_proj"), Matmul(rows, w, c.intermediate_size, "head.mlp.fc1"),
                   Matmul(rows, c.intermediate_size, w, "head.mlp.fc2", recomputed=False)])
    return block_products(tokens, rows, seq, CLIP_BLOCK, w, c.intermediate_size, c.num_attention_heads)
