"""Errors that reach the user as one line (no traceback): config mistakes, bad data paths."""


class MmpipeError(Exception):
    """Base class: the CLI prints ``mmpipe: error: <message>`` and exits with status 2."""


class ConfigError(MmpipeError):
    """A run-config or DeepSpeed-config mistake; the message names the file/key and the fix."""


class DataError(MmpipeError):
    """A data problem that stops the run (missing manifest, too many bad samples)."""
