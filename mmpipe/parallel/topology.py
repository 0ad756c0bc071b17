"""The one place that does rank arithmetic: pipe x data degrees and the batch equation.

    global batch = micro_batch_size x accumulation_steps x data_parallel

Rank layout is DeepSpeed's ``PipeDataParallelTopology`` (axes pipe, data), used as is so the
engine and mmpipe always agree on which rank holds which stage.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

from mmpipe.errors import ConfigError


def threads_per_rank(local_ranks: int) -> int:
    """CPU threads each rank computes with when ``local_ranks`` ranks share this machine's cores."""
    import os
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


@dataclass(frozen=True)
class Topology:
    world_size: int
    pipeline_stages: int
    micro_batch_size: int
    batch_size: int
    expert_parallel: int = 1

    def __post_init__(self):
        P, W = self.pipeline_stages, self.world_size
        if W % P:
            raise ConfigError(
                f"parallel.pipeline_stages={P} does not divide the world size {W}: launch a multiple of {P} "
                f"processes (e.g. deepspeed --num_gpus {P}) or change parallel.pipeline_stages")
        E = self.expert_parallel
        if E > 1 and self.data_parallel % E:
            raise ConfigError(
                f"parallel.expert_parallel={E} does not divide the data-parallel degree {self.data_parallel} "
                f"(world {W} / pipeline_stages {P}): the experts split over E data-parallel ranks of a stage; use an "
                f"expert_parallel dividing {self.data_parallel}, or launch a multiple of {P * E} processes")
        per_step = self.micro_batch_size * self.data_parallel
        if self.batch_size % per_step:
            raise ConfigError(
                f"train.batch_size={self.batch_size} is not a multiple of parallel.micro_batch_size="
                f"{self.micro_batch_size} x data-parallel degree {self.data_parallel} (= {per_step}); "
                f"use e.g. train.batch_size={max(per_step, self.batch_size // per_step * per_step)}")

    @classmethod
    def from_config(cls, cfg, world_size: int) -> "Topology":
        return cls(world_size=world_size, pipeline_stages=cfg.parallel.pipeline_stages,
                   micro_batch_size=cfg.parallel.micro_batch_size, batch_size=cfg.train.batch_size,
                   expert_parallel=cfg.parallel.expert_parallel)

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.pipeline_stages

    @property
    def accumulation_steps(self) -> int:
        return self.batch_size // (self.micro_batch_size * self.data_parallel)

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches in one global batch, over all data-parallel ranks."""
        return self.batch_size // self.micro_batch_size

    @cached_property
    def _ds_topo(self):
        from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
        return PipeDataParallelTopology(num_pp=self.pipeline_stages, num_dp=self.data_parallel)

    def coords(self, rank: int) -> tuple[int, int]:
        """(pipeline stage, data-parallel rank) of a global rank."""
        c = self._ds_topo.get_coord(rank)
        return c.pipe, c.data

    def rank_of(self, stage: int, dp_rank: int) -> int:
        return self._ds_topo.get_rank(pipe=stage, data=dp_rank)

    @property
    def reporting_rank(self) -> int:
        """The rank that owns the loss and writes metrics: last stage, data-parallel rank 0."""
        return self.rank_of(self.pipeline_stages - 1, 0)

    def is_first_stage(self, rank: int) -> bool:
        return self.coords(rank)[0] == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.coords(rank)[0] == self.pipeline_stages - 1

    def expert_rank(self, rank: int) -> int:
        """A rank's place in its expert-parallel group (consecutive data-parallel ranks of its stage: DeepSpeed's
        ``_create_expert_and_data_parallel`` groups)."""
        return self.coords(rank)[1] % self.expert_parallel

    def describe(self) -> str:
        return (f"world={self.world_size} pipeline={self.pipeline_stages} data_parallel={self.data_parallel} "
                + (f"expert_parallel={self.expert_parallel} " if self.expert_parallel > 1 else "") +
                f"micro_batch={self.micro_batch_size} accumulation={self.accumulation_steps} "
                f"global_batch={self.batch_size}")


def _parent_environment() -> Optional[set]:
    """The names in this process's launcher's own start-up environment (``/proc/PPID/environ``:
    what it was started with, not what it set for its children since); None where unreadable."""
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as fh:
            return {e.split(b"=", 1)[0].decode(errors="replace") for e in fh.read().split(b"\0") if e}
    except OSError:
        return None


def launched_by_a_thread_setting_launcher(env) -> bool:
    """torchrun (and accelerate launch, which starts ranks through it or sets ``ACCELERATE_*``) export
    OMP_NUM_THREADS=1 to their ranks when the user did not; the deepspeed launcher sets it only when
    asked (``--bind_cores_to_rank``), and plain ``python`` never."""
    return "TORCHELASTIC_RUN_ID" in env or any(k.startswith("ACCELERATE_") for k in env)


def cpu_threads(local_ranks: int, cpu_count: int, env=None, parent_env: Optional[set] = "read") -> tuple:
    """(threads this CPU rank computes with, why). An ``OMP_NUM_THREADS`` the user set is honoured;
    one its launcher set (``torchrun`` and ``accelerate launch`` export 1 for several processes: it is
    in this rank's environment but not in the launcher's own) is a default, not a choice, and would
    cut throughput: the rank takes its share of the cores instead, as under ``deepspeed``. Only
    second-guessed under such a launcher: a value exported in an interactive shell is not in the
    shell's start-up environment either, and under plain ``python`` it is always the user's."""
    env = os.environ if env is None else env
    share = max(1, cpu_count // max(1, local_ranks))
    value = env.get("OMP_NUM_THREADS")
    if value is None:
        return share, f"{cpu_count} cores / {local_ranks} local ranks"
    parent = None
    if launched_by_a_thread_setting_launcher(env):  # under plain python the parent is the user's shell
        parent = _parent_environment() if parent_env == "read" else parent_env
    if parent is not None and "OMP_NUM_THREADS" not in parent:
        return share, (f"{cpu_count} cores / {local_ranks} local ranks; OMP_NUM_THREADS={value} came from the "
                       "launcher, not the user (export it to choose)")
    try:
        return max(1, int(value)), f"OMP_NUM_THREADS={value}"
    except ValueError:
        return share, f"{cpu_count} cores / {local_ranks} local ranks (OMP_NUM_THREADS={value!r} is not a number)"
