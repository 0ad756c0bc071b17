"""The start method of mmpipe's own worker pools (cache preparation, data checks)."""
from __future__ import annotations


def pool_context(module: str):
    """A multiprocessing context whose workers do not inherit this process's threads: forkserver
    (workers fork from a server process that imported ``module`` once), else spawn. Plain fork from
    a process with threads (torch's, tokenizers', tqdm's monitor) can leave a worker waiting forever
    on a lock one of them held at the fork - seen in the test suite as a worker stuck in a futex wait."""
    from multiprocessing import get_all_start_methods, get_context
    if "forkserver" in get_all_start_methods():
        ctx = get_context("forkserver")
        ctx.set_forkserver_preload([module])
        return ctx
    return get_context("spawn")
