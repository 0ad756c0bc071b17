"""``mmpipe bench``: one module per bench; ``common`` launches runs and appends to BENCHMARKS.md."""
