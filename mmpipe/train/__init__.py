"""Training: resolve a run (``setup``), build its engine, the loop (``trainer``), checkpoints and
their policy, faults, step statistics, grouped clipping, evaluation, metrics, export."""
