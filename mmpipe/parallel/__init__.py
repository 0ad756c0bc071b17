"""Parallelism around DeepSpeed: the compatibility layer for its private APIs (``ds_compat``)."""
