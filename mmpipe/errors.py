"""Errors that reach the user as one line (no traceback): config mistakes, bad data paths."""
import re

# torch's DataLoader re-raises a worker's exception as ``type(e)(msg)`` with the worker's whole
# traceback as the message ("Caught DataError in DataLoader worker process 0.\nOriginal Traceback
# ...\nmmpipe.errors.DataError: <message>"): keep only <message>, as with num_workers=0
_WORKER_WRAP = re.compile(r"^Caught \w+ in DataLoader worker process \d+\.\nOriginal Traceback", re.S)


class MmpipeError(Exception):
    """Base class: the CLI prints ``mmpipe: error: <message>`` and exits with status 2."""

    def __init__(self, *args):
        if len(args) == 1 and isinstance(args[0], str) and _WORKER_WRAP.match(args[0]):
            last = args[0].rstrip().splitlines()[-1]
            args = (last.split(": ", 1)[1] if ": " in last else last,)
        super().__init__(*args)


class ConfigError(MmpipeError):
    """A run-config or DeepSpeed-config mistake; the message names the file/key and the fix."""


class DataError(MmpipeError):
    """A data problem that stops the run (missing manifest, too many bad samples)."""


class NoHFFormat(ConfigError):
    """The model has no transformers class computing the same outputs (``mmpipe export`` then
    writes mmpipe's own format); the message says why."""


def one_line(e: BaseException, *, last: bool = False) -> str:
    """An exception as one line: its message's first line (at most 200 characters), or with
    ``last`` the last line of its cause's message (where a library puts the actual complaint
    after context lines)."""
    if last:
        msg = str(getattr(e, "__cause__", None) or e).strip().splitlines()
        return msg[-1] if msg else type(e).__name__
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
