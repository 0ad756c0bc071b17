"""Dotted-key access to nested JSON dicts (DeepSpeed configs), shared by the DeepSpeed-JSON and
the Accelerate-environment resolution."""
from __future__ import annotations

AUTO = "auto"
MISSING = object()


def get(d: dict, dotted: str):
    """``d["a"]["b"]`` for ``"a.b"``, or ``MISSING``."""
    node = d
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def put(d: dict, dotted: str, value) -> None:
    *head, last = dotted.split(".")
    node = d
    for part in head:
        node = node.setdefault(part, {})
    node[last] = value
