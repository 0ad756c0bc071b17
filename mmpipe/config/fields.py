"""Typed config sections: a dataclass field with a one-line help, and a base class whose instances
can be frozen once a run's config is resolved (any later assignment is an error, not a silent
change of a config the run directory already recorded)."""
from __future__ import annotations

import dataclasses
from dataclasses import field


def option(default, help: str, ge=None, gt=None, le=None, lt=None, **kw):
    """A config field: its default, the one-line help ``mmpipe config --reference`` prints, and for
    a number the range it must lie in (``ge`` >=, ``gt`` >, ``le`` <=, ``lt`` <; checked at load, one line)."""
    meta = {"help": help}
    if (ge, gt, le, lt) != (None, None, None, None):
        meta["range"] = (ge, gt, le, lt)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def range_text(rng) -> str:
    ge, gt, le, lt = tuple(rng) + (None,) * (4 - len(rng))
    low = f">= {ge}" if ge is not None else (f"> {gt}" if gt is not None else "")
    high = f"<= {le}" if le is not None else (f"< {lt}" if lt is not None else "")
    if low and high:
        return f"{ge if ge is not None else gt} {'<=' if ge is not None else '<'} value {high}"
    return low or high


def in_range(value, rng) -> bool:
    ge, gt, le, lt = tuple(rng) + (None,) * (4 - len(rng))
    return ((ge is None or value >= ge) and (gt is None or value > gt) and (le is None or value <= le)
            and (lt is None or value < lt))


class Section:
    """Base of every config dataclass. ``seal()`` makes this section and every section below it
    read-only: a resolved run config is an object of its own, saved as-is, never changed after."""

    _frozen = False

    def __setattr__(self, name, value):
        if self._frozen:
            raise AttributeError(f"config is resolved and read-only: cannot set {type(self).__name__}.{name}; "
                                 "derive a new config (mmpipe.config.schema.replace) instead")
        object.__setattr__(self, name, value)

    def seal(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            subs = v.values() if isinstance(v, dict) else [v]
            for s in subs:
                if isinstance(s, Section):
                    s.seal()
        object.__setattr__(self, "_frozen", True)
        return self

    @property
    def frozen(self) -> bool:
        return self._frozen


def thawed_copy(section):
    """A deep, writable copy of a (possibly frozen) config section: how a resolved config is derived."""
    import copy
    out = copy.deepcopy(section)

    def thaw(s):
        if isinstance(s, Section):
            object.__setattr__(s, "_frozen", False)
            for f in dataclasses.fields(s):
                v = getattr(s, f.name)
                for sub in (v.values() if isinstance(v, dict) else [v]):
                    thaw(sub)
    thaw(out)
    return out
