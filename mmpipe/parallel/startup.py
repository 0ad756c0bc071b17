"""Process start-up: join DeepSpeed's process group on the accelerator's backend (NCCL on GPUs, gloo
on the CPU), a free port for one process without a launcher, and the CPU thread count per rank."""
from __future__ import annotations

import logging
import os
import socket
from typing import Optional

import torch
import torch.distributed as dist

from mmpipe.errors import ConfigError
from mmpipe.parallel.cpu_process import keep_freed_memory
from mmpipe.parallel.ds_compat import skip_cpu_shm_allreduce
from mmpipe.parallel.launchers import adopt, device_index
from mmpipe.parallel.topology import cpu_threads


# --------------------------------------------------------------------------------------------
# process setup
# --------------------------------------------------------------------------------------------
def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free local TCP port for a rendezvous, drawn from *below* the kernel's ephemeral range.

    Port 0 hands out an ephemeral port, the same range every outgoing connection (gloo's, the
    TCPStore clients') takes its source port from: a run started beside another could find its
    port taken by the other's connections between choosing and binding it. Below that range only
    listeners live, so a random free one there stays free."""
    import random
    hi = max(_ephemeral_floor(), 12000)
    rng = random.Random()  # (seeded from the OS: two processes choosing at once draw apart)
    for _ in range(200):
        port = rng.randrange(10000, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_minutes: Optional[float] = None) -> tuple[int, int]:
    """Join (or, under plain ``python``, create) the process group with the accelerator's backend;
    the launcher's variables first (``launchers.adopt``: Slurm's and MPI's become torch's)."""
    adopt()
    if "RANK" not in os.environ:  # plain `python launch/train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    os.environ.setdefault("LOCAL_RANK", "0")
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.utils.logger.setLevel(logging.WARNING)
    if get_accelerator().device_name() != "cpu":  # before the first collective: NCCL uses the current device
        get_accelerator().set_device(device_index(int(os.environ["LOCAL_RANK"]), get_accelerator().device_count()))
    else:  # before the model and its activations exist
        keep_freed_memory()
    global _OWN_GROUP
    if not dist.is_initialized():
        _OWN_GROUP = True  # this process's command made it, and ends it (close_distributed)
        from datetime import timedelta
        if get_accelerator().device_name() == "cpu":
            skip_cpu_shm_allreduce()
        kw = {"timeout": timedelta(minutes=timeout_minutes)} if timeout_minutes else {}
        try:
            join_restarted_attempt(get_accelerator(), kw.get("timeout"))
            deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), **kw)
        except RuntimeError as e:  # torch's DistNetworkError: the rendezvous port is taken
            if "EADDRINUSE" not in str(e) and "address already in use" not in str(e).lower():
                raise
            port = os.environ.get("MASTER_PORT", "?")
            raise ConfigError(f"port {port} (MASTER_PORT) is already in use, by another run or program: give the "
                              "launcher another one (deepspeed --master_port N, torchrun --master_port N, accelerate "
                              "launch --main_process_port N)") from None
    global CPU_THREADS
    if get_accelerator().device_name() == "cpu":
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or dist.get_world_size())
        threads, why = cpu_threads(local, os.cpu_count() or 1)
        torch.set_num_threads(threads)
        CPU_THREADS = f"{threads} CPU thread{'s' if threads != 1 else ''} ({why})"
    return dist.get_rank(), dist.get_world_size()


def join_restarted_attempt(accelerator, timeout) -> None:
    """A group restarted by torchrun (``--max-restarts``) meets in its agent's store, which torch keeps
    across attempts (the static rendezvous's and c10d's shared store alike) with the failed attempt's
    keys in it: a process group made there reads the dead ranks' addresses (gloo: "connectFullMesh
    failed ... Connection refused"). A restarted attempt makes its group under a prefix of its own;
    DeepSpeed then adopts the group (it makes one only where none is)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt in ("", "0"):
        return
    from datetime import timedelta
    timeout = timeout or timedelta(minutes=30)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout=timeout)
    kw = {"device_id": accelerator.device(int(os.environ["LOCAL_RANK"]))} \
        if accelerator.device_name() == "cuda" and world > 1 else {}
    dist.init_process_group(accelerator.communication_backend_name(), store=dist.PrefixStore(
        f"/mmpipe/attempt_{attempt}", agent), rank=rank, world_size=world, timeout=timeout, **kw)


_OWN_GROUP = False  # init_distributed created the process group (not a caller before it)


def close_distributed(finished: bool = True, force: bool = False) -> None:
    """End the process group init_distributed made, before the interpreter's exit: left to the exit,
    gloo's worker threads can still hold work while it is torn down and the process aborts
    ("terminate called without an active exception", exit -6), after a run that succeeded or a
    one-line error alike. ``finished`` (every rank is here): a barrier, then the destroy (torch's
    documented shutdown). After an error a peer may be gone: no barrier, and with NCCL across ranks
    no destroy either (it can wait for the lost peer); gloo's is local. Through DeepSpeed, which also
    forgets its cached groups, so a next run in this process starts afresh. ``force``: a group a
    caller made too (a process about to ``execv`` itself: ``train.replan``)."""
    global _OWN_GROUP
    if not ((_OWN_GROUP or force) and dist.is_available() and dist.is_initialized()):
        return
    if not finished and dist.get_world_size() > 1 and dist.get_backend() != "gloo":
        return
    import gc

    import deepspeed.comm
    gc.collect()  # the engine's pending work goes before its groups do
    if finished:
        dist.barrier()
    deepspeed.comm.destroy_process_group()
    _OWN_GROUP = False


CPU_THREADS = None  # this rank's CPU threads and why, for its memory line (GPU ranks: None)
