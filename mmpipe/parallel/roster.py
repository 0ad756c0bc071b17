"""Who is in the run: every rank's host and pid, gathered once at start-up, so that a rank that
loses contact with its peers can name the one that is gone (its process no longer exists).

A dead peer surfaces in the survivors as a failed collective (gloo: "Connection closed by peer"
at once; NCCL: after ``train.collective_timeout_minutes``), and a launcher (``deepspeed``,
``torchrun``, ``accelerate``) that sees a rank exit non-zero terminates the others within about a
second. Only processes on this host can be checked; ranks on other hosts are named by host.
"""
from __future__ import annotations

import os
import socket
from typing import Optional

_ROSTER: list = []  # [(rank, host, pid)] once gathered


def gather() -> None:
    """Collective: record every rank's (host, pid). Call once, right after the process group starts."""
    import torch.distributed as dist
    me = (socket.gethostname(), os.getpid())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    _ROSTER[:] = [(r, h, p) for r, (h, p) in enumerate(everyone)]


def _alive(pid: int) -> bool:
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def gone() -> list:
    """(rank, host, pid) of the ranks on this host whose process no longer runs."""
    host = socket.gethostname()
    return [(r, h, p) for r, h, p in _ROSTER if h == host and p != os.getpid() and not _alive(p)]


def describe_lost(wait_s: float = 2.0) -> Optional[str]:
    """'rank 1 (pid 123)' for the ranks found gone (waiting up to ``wait_s`` for a dying process to
    disappear), or None when every rank on this host still runs (the lost one is on another host)."""
    import time
    if not _ROSTER:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        dead = gone()
        if dead or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if not dead:
        others = sorted({h for _, h, _ in _ROSTER if h != socket.gethostname()})
        return f"a rank on {', '.join(others)}" if others else None
    return ", ".join(f"rank {r} (pid {p})" for r, _, p in dead)
