"""The run's record of unusable training samples, the same in every layout and across a resume.

Each data-reading rank reports the bad files its micro-batches met; the trainer merges the
reports of all ranks once per step (``add``), so a file is counted once however many ranks or
epochs meet it. The record (files and samples drawn) is saved in every checkpoint and restored
on ``--resume``, so a resumed run counts exactly what the straight run counts.

The limit ``data.max_bad_fraction`` is checked against the training set's size, or, for a stream
(shards) of unknown size, against all samples drawn so far (this run and before its resumes),
once enough have been drawn for the fraction to mean something (20 / limit).
"""
from __future__ import annotations

import math
from typing import Optional


class BadSampleLedger:
    def __init__(self, max_fraction: float, n_train: Optional[int]):
        self.max_fraction = max_fraction
        self.n_train = n_train or None
        self.files: dict = {}  # path -> why, in the order found
        self.drawn = 0
        self.min_drawn = math.ceil(20 / max(max_fraction, 1e-9))

    @property
    def count(self) -> int:
        return len(self.files)

    def unknown(self, reports) -> list:
        """The (path, why) reports not yet recorded, each path once."""
        out, seen = [], set()
        for path, why in reports:
            if path not in self.files and path not in seen:
                seen.add(path)
                out.append((path, why))
        return out

    def add(self, reports, drawn: int = 0) -> list:
        """Record reports (from every rank, in rank order) and samples drawn; returns the new ones."""
        new = self.unknown(reports)
        self.files.update(new)
        self.drawn += drawn
        return new

    def error(self) -> Optional[str]:
        """The message that stops the run when the limit is exceeded, else None."""
        denom = self.n_train or (self.drawn if self.drawn >= self.min_drawn else None)
        if not denom or self.count <= self.max_fraction * denom:
            return None
        what = f"the {self.n_train} training samples" if self.n_train else f"the {self.drawn} samples drawn so far"
        first = next(iter(self.files.items()))
        return (f"data.max_bad_fraction={self.max_fraction} exceeded: {self.count} of {what} are unusable "
                f"({100 * self.count / denom:.1f}%), e.g. {first[0]} ({first[1]}); fix the data (see the "
                "skipped-sample warnings, or run mmpipe data check) or raise the limit")

    def state_dict(self) -> dict:
        return {"files": [[p, w] for p, w in self.files.items()], "drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.files = {p: w for p, w in state.get("files", [])}
        self.drawn = int(state.get("drawn", 0))
