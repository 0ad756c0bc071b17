"""Planning from measured costs: the layer profiler, collectives, one memory model, partitions,
the schedule simulator, placement into a ``Plan``, micro-batch sizing, layouts of N ranks, charts."""
