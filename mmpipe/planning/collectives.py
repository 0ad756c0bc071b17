"""Measured communication: stage-to-stage transfers (``measure_p2p``), collectives per group size
(all-reduce, all-gather, reduce-scatter), the ZeRO-2/3 hook probes and the CPU stretch factor, fitted
into one ``CommModel`` (latency + seconds per byte) that the layout predictions use; cached on disk."""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from mmpipe.data.json_files import write_json
from mmpipe.parallel.cpu_process import keep_freed_memory
from mmpipe.parallel.ds_compat import skip_cpu_shm_allreduce
from mmpipe.parallel.runtime import initialize
from mmpipe.planning.cache import cache_dir
from mmpipe.planning.memory import divisors


# ---- stage-to-stage transfers ------------------------------------------------------------------------
def pingpong(rank: int, buf) -> None:
    """Rank 0 sends ``buf`` to rank 1 and receives it back (one round trip)."""
    import torch.distributed as dist
    if rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    else:
        dist.recv(buf, 0)
        dist.send(buf, 0)


def _p2p_worker(rank: int, port: int, sizes: list, repeats: int, backend: str, device: str, out) -> None:
    import os

    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=2)
    res = {}
    for n in sizes:
        buf = torch.zeros(max(1, n // 4), dtype=torch.float32, device=device)
        times = []
        for _ in range(repeats + 2):  # ping-pong: half a round trip is one transfer
            dist.barrier()
            t0 = time.perf_counter()
            pingpong(rank, buf)
            times.append((time.perf_counter() - t0) / 2)
        res[n] = statistics.mean(times[2:])  # the mean: a step pays the slow transfers too (see P2P_REPEATS)
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


# Small transfers between processes have a long tail here (median 0.1 ms, mean 0.1-0.5 ms, single
# ones 3-12 ms): a pipeline step pays every one of them, so transfers are costed by their mean over
# enough round trips to see the tail.
P2P_REPEATS = 40


def measure_p2p(sizes: list, repeats: int = P2P_REPEATS) -> dict:
    """{bytes: seconds} for one send/recv between two processes with the accelerator's backend
    (the mean over ``repeats`` ping-pongs)."""
    import socket

    import torch.multiprocessing as mp
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    device = acc.device_name() if acc.device_name() == "cpu" else f"{acc.device_name()}:0"
    procs = [ctx.Process(target=_p2p_worker, args=(r, port, sorted(set(sizes)), repeats,
                                                    acc.communication_backend_name(), device, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join()
    return res


def fit_comm(samples: dict) -> tuple[float, float]:
    """Least-squares (latency seconds, seconds per byte) from ``measure_p2p``'s result."""
    xs, ys = list(samples), [samples[k] for k in samples]
    if len(xs) == 1:
        return ys[0], 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
    return max(0.0, my - slope * mx), slope


OPS = ("allreduce", "allgather", "reduce_scatter")


@dataclass
class CommModel:
    """Collective and point-to-point costs: ``ops[op][n] = (latency s, s per byte)`` for a group of
    n ranks (bytes = the full buffer: the gradients reduced, the weights gathered); ``p2p``: one
    send/recv of a buffer."""
    backend: str = "gloo"
    ops: dict = field(default_factory=dict)
    p2p: tuple = (0.0, 0.0)
    measured: bool = False
    # ZeRO-3's fixed cost per module, bandwidth excluded, by group size: (per pass (forward or
    # backward) of a module whose parameters are partitioned and gathered, per pass of one whose
    # parameters stay persistent, per optimizer step of a partitioned one, per step of a persistent
    # one: DeepSpeed all-gathers every persistent parameter after each step, one tensor at a time)
    zero3: dict = field(default_factory=dict)
    # ZeRO-2's cost beyond ZeRO-0's (whose all-reduce of the same bytes the model already charges),
    # by group size: (per parameter tensor per micro-batch: its gradient hook and bucket bookkeeping,
    # per gradient byte per micro-batch: the copies into and out of the reduce buckets, per gradient
    # byte per optimizer step beyond the 1/n share of ZeRO-0's step): measured by DeepSpeed runs
    zero2: dict = field(default_factory=dict)
    # CPU only: how much slower one rank computes when n single-thread ranks compute at once on this
    # machine's cores, measured (time-sharing and the shared cache and memory included), by n
    stretch: dict = field(default_factory=dict)

    def zero3_module(self, n: int) -> Optional[tuple]:
        if n <= 1 or not self.zero3:
            return None
        table = {int(k): v for k, v in self.zero3.items()}
        k = n if n in table else min(table, key=lambda x: abs(x - n))
        v = (tuple(table[k]) + (0.0, 0.0))[:4]  # an older 2-value entry: no step cost measured
        if k == n:
            return v
        # hooks are per rank; the gather latencies (a pass's and the step's) grow like a ring
        return tuple(x * (n - 1) / max(1, k - 1) if i != 1 else x for i, x in enumerate(v))

    def zero2_costs(self, n: int) -> Optional[tuple]:
        """(s per tensor per micro-batch, s per byte per micro-batch, s per byte per step) at n ranks
        (the nearest measured group size: these are per-rank copies and hooks), None if unmeasured."""
        if n <= 1 or not self.zero2:
            return None
        table = {int(k): v for k, v in self.zero2.items()}
        return tuple(table[n if n in table else min(table, key=lambda x: abs(x - n))])

    def time(self, op: str, n: int, nbytes: float) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        table = {int(k): v for k, v in self.ops.get(op, {}).items()}
        if not table:
            return 0.0
        if n in table:
            lat, spb = table[n]
            return lat + spb * nbytes
        # ring scaling from the nearest measured group size: latency ~ (n-1), bytes ~ (n-1)/n
        k = min(table, key=lambda x: abs(x - n))
        lat, spb = table[k]
        return lat * (n - 1) / max(1, k - 1) + spb * nbytes * ((n - 1) / n) / ((k - 1) / k)

    @classmethod
    def median(cls, models: list) -> "CommModel":
        """One model from several measurements of the same backend: every figure (each op's latency
        and seconds per byte, send/recv, the ZeRO-3 costs, the stretch) is its median over them."""
        def med(values):
            return tuple(statistics.median(v) for v in zip(*values))
        first = models[0]
        ops = {op: {n: med([m.ops[op][n] for m in models if n in m.ops.get(op, {})]) for n in t}
               for op, t in first.ops.items()}
        zero3 = {n: med([m.zero3[n] for m in models if n in m.zero3]) for n in first.zero3}
        zero2 = {n: med([m.zero2[n] for m in models if n in m.zero2]) for n in first.zero2}
        stretch = {n: statistics.median(m.stretch[n] for m in models if n in m.stretch) for n in first.stretch}
        return cls(first.backend, ops, med([m.p2p for m in models]), all(m.measured for m in models), zero3, zero2,
                   stretch)

    def to_dict(self) -> dict:
        return {"backend": self.backend, "ops": {op: {str(n): list(v) for n, v in t.items()} for op, t in self.ops.items()},
                "p2p": list(self.p2p), "measured": self.measured,
                "zero3": {str(n): list(v) for n, v in self.zero3.items()},
                "zero2": {str(n): list(v) for n, v in self.zero2.items()},
                "stretch": {str(n): v for n, v in self.stretch.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "CommModel":
        return cls(d["backend"], {op: {int(n): tuple(v) for n, v in t.items()} for op, t in d["ops"].items()},
                   tuple(d["p2p"]), d.get("measured", True),
                   {int(n): tuple(v) for n, v in d.get("zero3", {}).items()},
                   {int(n): tuple(v) for n, v in d.get("zero2", {}).items()},
                   {int(n): float(v) for n, v in d.get("stretch", {}).items()})


# ---- measuring the collectives --------------------------------------------------------------------------
def _coll_worker(rank: int, n: int, port: int, sizes: list, repeats: int, backend: str, device: str, out) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import deepspeed
    if device == "cpu":  # as a training rank runs (and no shared-memory buffer left in /dev/shm)
        keep_freed_memory()
        skip_cpu_shm_allreduce()
    deepspeed.init_distributed(backend, verbose=False)
    res = {op: {} for op in OPS}
    res["p2p"] = {}
    for nbytes in sizes:
        numel = max(n, nbytes // 4 // n * n)
        full = torch.zeros(numel, dtype=torch.float32, device=device)
        shard = torch.zeros(numel // n, dtype=torch.float32, device=device)
        ops = {"allreduce": lambda: dist.all_reduce(full),
               "allgather": lambda: dist.all_gather_into_tensor(full, shard),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full)}
        if n == 2:
            pass
            ops["p2p"] = lambda: pingpong(rank, full)
        for op, f in ops.items():
            if op == "p2p":  # half a round trip, its mean: a pipeline pays the slow transfers too
                pass
                res[op][numel * 4] = _median_time(f, P2P_REPEATS, stat=statistics.mean) / 2
            else:
                res[op][numel * 4] = _median_time(f, repeats)
    res["zero3"] = _zero3_probe(device, repeats)
    res["stretch"] = _stretch_probe(rank) if device == "cpu" else 1.0
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def _median_time(f, repeats: int, after=None, stat=None) -> float:
    """Median (or ``stat``) over ``repeats`` (after 2 warm-ups) of ``f`` started together on every
    rank; ``after`` (untimed) runs after each."""
    import time

    import torch.distributed as dist
    times = []
    for _ in range(repeats + 2):
        dist.barrier()
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
        if after is not None:
            after()
    return (stat or statistics.median)(times[2:])


def _stretch_probe(rank: int, iters: int = 30) -> float:
    """Median time of a transformer-sized MLP forward + backward with every rank computing at once,
    over its time with rank 0 computing alone (the others block in a barrier)."""
    import time

    import torch
    import torch.distributed as dist
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    x = torch.randn(256, 256)

    def work() -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            mlp(x).sum().backward()
        return time.perf_counter() - t0
    work()  # warm-up
    alone, together = [], []
    for _ in range(5):  # interleaved, so a drift of this machine's speed hits both alike
        dist.barrier()
        if rank == 0:
            alone.append(work())
        dist.barrier()
        together.append(work())
    t = torch.tensor([statistics.median(together)])
    dist.all_reduce(t)  # the mean over ranks
    return float(t) / dist.get_world_size() / statistics.median(alone) if rank == 0 else 0.0


def _zero3_probe(device: str, repeats: int, modules: int = 16) -> dict:
    """DeepSpeed ZeRO-3's cost per module per pass on this backend: forward + backward of a chain of
    ``modules`` tiny-input modules under a ZeRO-3 engine minus under a ZeRO-0 engine, for modules
    whose weights are partitioned (a 512x256 Linear, above the persistence threshold: gathered and
    released every pass) and modules small enough to stay persistent (LayerNorm(256): hooks only);
    and the optimizer step's cost per module beyond ZeRO-0's, timed alone."""
    import logging

    import torch
    from deepspeed.utils import logger
    from torch import nn
    logger.setLevel(logging.ERROR)

    class Chain(nn.Module):
        def __init__(self, big: bool):
            super().__init__()
            self.big = big
            self.m = nn.ModuleList(nn.Linear(512, 256) if big else nn.LayerNorm(256) for _ in range(modules))

        def forward(self, x):
            for m in self.m:
                y = m(x)
                x = torch.cat([y, y], -1) if self.big else y
            return x.sum()

    res = {}
    n = torch.distributed.get_world_size()
    for big in (True, False):
        t, s = {}, {}
        for z in (0, 2, 3):
            net = Chain(big)
            cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": z}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
            eng, *_ = initialize(model=net, config=cfg, model_parameters=net.parameters())
            x = torch.randn(1, 512 if big else 256, device=device)
            # forward + backward timed, each followed by a step, as in training; then the step alone
            t[z] = _median_time(lambda: eng.backward(eng(x)), repeats, after=eng.step)
            eng.backward(eng(x))
            s[z] = _median_time(eng.step, repeats, after=lambda: eng.backward(eng(x)))
            if hasattr(eng, "destroy"):
                eng.destroy()
        key = "partitioned" if big else "persistent"
        res[key] = max(0.0, (t[3] - t[0]) / (2 * modules))
        # ZeRO-3's step beyond its 1/n share of ZeRO-0's (which the cost model already charges)
        res[key + "_step"] = max(0.0, (s[3] - s[0] / n) / modules)
        # ZeRO-2, per micro-batch (forward + backward; the same all-reduce as ZeRO-0's) and per step
        res["zero2_" + key] = (t[2] - t[0], s[2] - s[0] / n)
    res["partitioned_bytes"] = (512 * 256 + 256) * 4
    res["chains"] = {"partitioned": (2 * modules, modules * (512 * 256 + 256) * 4),  # (tensors, gradient bytes)
                     "persistent": (2 * modules, modules * 2 * 256 * 4)}
    return res


def zero2_fit(probe: dict, allgather_s_per_byte: float) -> tuple:
    """ZeRO-2's (s per tensor per micro-batch, s per byte per micro-batch, s per byte per step) from
    the probe's two chains (many bytes per tensor, few): two equations in the two per-micro-batch
    unknowns; the step's cost per byte beyond the all-gather of the updated partitions the model
    already charges. Negative solutions (noise) are 0."""
    (tb, bb), (ts, bs) = probe["chains"]["partitioned"], probe["chains"]["persistent"]
    yb, ys = probe["zero2_partitioned"][0], probe["zero2_persistent"][0]
    det = tb * bs - ts * bb
    per_tensor = max(0.0, (yb * bs - ys * bb) / det) if det else 0.0
    per_byte = max(0.0, (yb - tb * per_tensor) / bb)
    step = max(0.0, probe["zero2_partitioned"][1] / bb - allgather_s_per_byte)
    return per_tensor, per_byte, step


def _fit(samples: dict) -> tuple:
    return fit_comm({int(k): v for k, v in samples.items()})


def measure_collectives(group_sizes: list, sizes=(4096, 1 << 18, 1 << 21, 1 << 23), repeats: int = 9,
                        log=None) -> CommModel:
    """Time all-reduce, all-gather, reduce-scatter (and send/recv at 2) for each group size with the
    accelerator's backend, in spawned processes; fit latency + bytes / bandwidth per op and size; and
    ZeRO-3's fixed cost per module (``_zero3_probe``)."""
    import socket

    import torch.multiprocessing as mp
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    backend = acc.communication_backend_name()
    device = acc.device_name() if acc.device_name() == "cpu" else f"{acc.device_name()}:0"
    model = CommModel(backend=backend, measured=True)
    for n in _group_sizes(group_sizes):
        if log:
            log(f"timing collectives over {n} processes ({backend}) ...")
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_coll_worker, args=(r, n, port, list(sizes), repeats, backend, device, q))
                 for r in range(n)]
        for p in procs:
            p.start()
        res = q.get(timeout=600)
        for p in procs:
            p.join()
        for op in OPS:
            model.ops.setdefault(op, {})[n] = _fit(res[op])
        if res["p2p"]:
            model.p2p = _fit(res["p2p"])
        z3 = res["zero3"]  # per module-pass, less the bandwidth share its gathers and reduce-scatter count
        b = z3["partitioned_bytes"]
        bw = (2 * model.ops["allgather"][n][1] + model.ops["reduce_scatter"][n][1]) * b / 2
        model.zero3[n] = (max(0.0, z3["partitioned"] - bw), z3["persistent"], z3["partitioned_step"],
                          z3["persistent_step"])
        model.zero2[n] = zero2_fit(z3, model.ops["allgather"][n][1])
        if device == "cpu":
            model.stretch[n] = res["stretch"]
    return model


def get_comm_model(group_sizes: list, use_cache: bool = True, log=None, refresh: bool = False) -> CommModel:
    """``measure_collectives`` cached per backend, device, host and group sizes (``$MMPIPE_CACHE``);
    ``refresh``: measure again and replace the cached entry."""
    import socket

    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    sizes = _group_sizes(group_sizes)
    key = f"comm6-{acc.communication_backend_name()}-{acc.device_name()}-{socket.gethostname()}-" + "_".join(map(str, sizes))
    path = os.path.join(cache_dir(), key + ".json")
    if use_cache and not refresh and os.path.isfile(path):
        with open(path) as fh:
            if log:
                log(f"collective costs from cache {path}")
            return CommModel.from_dict(json.load(fh))
    model = measure_collectives(sizes, log=log)
    if use_cache:
        write_json(path, model.to_dict())
    return model


def comm_group_sizes(world: int) -> list:
    """The group sizes whose collectives a world's layouts use (2 is always timed: send/recv)."""
    return _group_sizes(divisors(world))


def _group_sizes(sizes) -> list:
    return sorted({n for n in sizes if n >= 2} | {2})

