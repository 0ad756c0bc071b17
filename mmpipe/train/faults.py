"""TODO docstring."""
from __future__ import annotations
from typing import Optional
import torch.distributed as dist
from mmpipe.errors import ConfigError, DataError, MmpipeError


def _warn(msg: str) -> None:
    print(f"[mmpipe] warning: {msg}", flush=True)


def _rank0_decides(rank: int, decide):
    """Run ``decide()`` on rank 0 and hand its result to every rank; an mmpipe error it raises is
    raised on every rank (and printed once)."""
    result = [None]
    if rank == 0:
        try:
            result = [decide()]
        except MmpipeError as e:
            result = [e]
    dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], MmpipeError):
        raise _everywhere(type(result[0]), str(result[0]))
    return result[0]


def _everywhere(cls, msg: str) -> MmpipeError:
    err = cls(msg)
    err.everywhere = True  # every rank raises it: printed once (by rank 0)
    return err


def agree(rank: int, work):
    """Run ``work()`` on every rank; if it raised on any rank, raise on every rank, so no rank is
    left waiting in a collective for one that has already exited. An mmpipe error is raised alike
    everywhere (printed once, naming the rank it came from); any other exception is re-raised with
    its traceback on its own rank, and the others stop with one line naming that rank."""
    err, original = None, None
    try:
        result = work()
    except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised
        err, original, result = (type(e).__name__, str(e), isinstance(e, MmpipeError)), e, None
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, err)
    for r, e in enumerate(errors):
        if e is None:
            continue
        name, msg, ours = e
        if ours:
            cls = DataError if name == "DataError" else ConfigError
            raise _everywhere(cls, msg if r == 0 else f"[rank {r}] {msg}")
        if original is not None and not isinstance(original, MmpipeError):
            raise original
        raise MmpipeError(f"stopped: rank {r} failed with {name} (its traceback is printed above)")
    return result


# --------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------
def counts_as_bad(record: dict, previous_loss_scale: Optional[float]) -> bool:
    """Whether a step counts towards ``train.max_bad_steps``: a skipped step, unless fp16's dynamic
    loss scaler skipped it and lowered its scale (calibrating, as it does at the start of every fp16
    run: DeepSpeed's overflow check, not a broken run; still counted in ``skipped_steps``)."""
    if not record.get("skipped"):
        return False
    scale = record.get("loss_scale")
    return not (scale is not None and previous_loss_scale is not None and scale < previous_loss_scale)
