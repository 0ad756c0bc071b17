"""open_clip's model config for a SigLIP dual encoder's shape: what ``open_clip_train --siglip`` trains
beside mmpipe in ``mmpipe bench gpu``. open_clip ships SigLIP as timm's SigLIP ViT (``timm_pool: map``,
its attention-pooling head) and its own text transformer run as SigLIP's (bidirectional, pooled at the
last position, a projection with bias): ``ViT-B-16-SigLIP``'s config, written here from the family's
sizes. Without timm, or for a shape timm has no SigLIP ViT of (the tiny test configs), the image tower
is open_clip's own ViT at the same sizes (a class token, and the patches averaged where SigLIP's
attention-pooling head attends over them), and ``open_clip_vision`` says which one it is."""
from __future__ import annotations

import importlib.util
from typing import Optional

# (width, blocks, patch, image size) -> timm's SigLIP ViT of that shape (its MLP width and heads: TIMM_WIDTHS)
TIMM_SIGLIP = {(768, 12, 16, 224): "vit_base_patch16_siglip_224", (768, 12, 16, 256): "vit_base_patch16_siglip_256",
               (768, 12, 16, 384): "vit_base_patch16_siglip_384", (768, 12, 16, 512): "vit_base_patch16_siglip_512",
               (1024, 24, 16, 256): "vit_large_patch16_siglip_256", (1024, 24, 16, 384): "vit_large_patch16_siglip_384",
               (1152, 27, 14, 224): "vit_so400m_patch14_siglip_224", (1152, 27, 14, 384): "vit_so400m_patch14_siglip_384"}
TIMM_WIDTHS = {768: (3072, 12), 1024: (4096, 16), 1152: (4304, 16)}  # width -> (MLP width, attention heads)


def timm_siglip_name(vision_config) -> Optional[str]:
    """timm's SigLIP ViT of this shape (transformers ``SiglipVisionConfig``), or None: none of that shape,
    or timm not installed."""
    v = vision_config
    name = TIMM_SIGLIP.get((v.hidden_size, v.num_hidden_layers, v.patch_size, v.image_size))
    if name is None or (v.intermediate_size, v.num_attention_heads) != TIMM_WIDTHS[v.hidden_size]:
        return None
    return name if importlib.util.find_spec("timm") is not None else None


def open_clip_vision(family) -> str:
    """What image tower ``open_clip_config`` gives open_clip (said beside the peer's figures)."""
    name = timm_siglip_name(family.vision_config)
    return f"timm {name}" if name else "open_clip's ViT at SigLIP's sizes (no timm SigLIP ViT of this shape here)"


def open_clip_config(family) -> dict:
    """open_clip's model config of this family's shape (see the module's text); the tokenizer is the
    caller's (open_clip's would be downloaded from the hub)."""
    v, t = family.vision_config, family.text_config
    name = timm_siglip_name(v)
    if name:
        vision = {"image_size": v.image_size, "timm_model_name": name, "timm_model_pretrained": False,
                  "timm_pool": "map", "timm_proj": "none"}
    else:
        vision = {"image_size": v.image_size, "patch_size": v.patch_size, "layers": v.num_hidden_layers,
                  "width": v.hidden_size, "head_width": v.hidden_size // v.num_attention_heads,
                  "mlp_ratio": v.intermediate_size / v.hidden_size, "pool_type": "avg", "no_ln_pre": True,
                  "norm_kwargs": {"eps": v.layer_norm_eps}}
    return {"embed_dim": family.projection_dim, "init_logit_bias": -10, "custom_text": True, "vision_cfg": vision,
            "text_cfg": {"context_length": t.max_position_embeddings, "vocab_size": t.vocab_size, "width": t.hidden_size,
                         "heads": t.num_attention_heads, "layers": t.num_hidden_layers,
                         "mlp_ratio": t.intermediate_size / t.hidden_size, "no_causal_mask": True, "proj_bias": True,
                         "pool_type": "last", "norm_kwargs": {"eps": t.layer_norm_eps}}}
