"""The runtime of parallelism: rank arithmetic (``topology``), process start-up, the ``Plan`` contract,
pipeline layers and module, the stage clock, the strategies (data parallel, pipeline) and every
private DeepSpeed API mmpipe touches (``ds_compat``). Imports only ``mmpipe.errors``."""
