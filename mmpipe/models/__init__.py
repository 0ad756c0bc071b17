"""Plain image/text models: no parallelism here (see mmpipe.pipeline for that)."""
from mmpipe.models.clip import ClipLoss, DualEncoder, ModelSpec, build_model

__all__ = ["ClipLoss", "DualEncoder", "ModelSpec", "build_model"]
