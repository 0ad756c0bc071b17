"""The ``mmpipe`` command line: one module per command (``main`` builds the parser)."""
