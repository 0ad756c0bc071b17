"""``log.profile: [first, last]``: those training steps under ``torch.profiler`` (host ops, and the
device's kernels where there is one): ``OUTPUT/profile/rank{r}.json`` (open in ui.perfetto.dev) and
``rank{r}.txt``, the operators by device time and by host time, with the steps' wall time beside the
device's busy time (what the host adds shows as the difference)."""
from __future__ import annotations

import os
import time
from typing import Optional

import torch


class StepProfiler:
    """Starts before step ``first`` and writes its files after step ``last``."""

    def __init__(self, steps: Optional[list], out_dir: str, rank: int, device_name: str):
        self.first, self.last = steps if steps else (None, None)
        self.out_dir, self.rank, self.on_device = out_dir, rank, device_name != "cpu"
        self.prof, self.t0 = None, 0.0

    def before(self, step: int) -> None:
        if step != self.first:
            return
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_device and torch.cuda.is_available() else [])
        self.prof = profile(activities=acts)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def after(self, step: int) -> Optional[str]:
        """After each step; at ``last``, the files (returns the .txt path)."""
        if self.prof is None or step != self.last:
            return None
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        d = os.path.join(self.out_dir, "profile")
        os.makedirs(d, exist_ok=True)
        self.prof.export_chrome_trace(os.path.join(d, f"rank{self.rank}.json"))
        events = self.prof.key_averages()
        device = sum(e.self_device_time_total for e in events) / 1e6 if self.on_device else 0.0
        n = self.last - self.first + 1
        lines = [f"steps {self.first}-{self.last}: wall {wall / n * 1e3:.1f} ms per step"
                 + (f", device kernels {device / n * 1e3:.1f} ms per step ({100 * device / wall:.0f}% busy)"
                    if self.on_device else "")]
        if self.on_device:
            lines += ["", "by device time:", events.table(sort_by="self_device_time_total", row_limit=30)]
        lines += ["", "by host time:", events.table(sort_by="self_cpu_time_total", row_limit=30)]
        path = os.path.join(d, f"rank{self.rank}.txt")
        with open(path, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        self.prof = None
        return path
