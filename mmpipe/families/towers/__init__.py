"""Reusable tower builders (ViT/ResNet, CLIP-text/BERT) and transformers weight rules."""
