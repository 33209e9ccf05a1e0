"""The per-token record of a decode: for each row and step, what was drafted, what the target kept.

Terms: a step keeps its first `accepted` drafts, then the target's own token: a *correction* after
a rejection, a *bonus* after all gamma. An accepted draft that prompt lookup proposed is *looked
up*; the prefill and target-only steps yield *target* tokens. The device tensors reach the host
once, at the end; `on_step` costs one extra sync per step.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

# How a committed token came, in the order a legend lists them.
KINDS = ("accepted", "looked_up", "corrected", "bonus", "target")


@dataclass
class StepRecord:
    """One row's step; `time_s` from the decode's start to when the host saw it."""

    drafted: list[int]
    accepted: int
    target_token: int
    looked_up: list[bool]
    committed: int
    time_s: float

    @property
    def target_kind(self) -> str:
        """`target` without drafts, `bonus` after gamma accepted drafts, else `corrected`."""
        if not self.drafted:
            return "target"
        return "bonus" if self.accepted == len(self.drafted) else "corrected"

    def tokens(self) -> list[tuple[int, str]]:
        """The committed (token id, kind) pairs of this step."""
        kept = [
            (token, "looked_up" if looked else "accepted")
            for token, looked in zip(self.drafted[: self.accepted], self.looked_up)
        ]
        return (kept + [(self.target_token, self.target_kind)])[: self.committed]


@dataclass
class RowRecord:
    """One prompt's decode: `steps[0]` is the prefill, then one entry per step."""

    prompt_length: int
    steps: list[StepRecord] = field(default_factory=list)
    drafter: str | None = None

    @property
    def first_token(self) -> int | None:
        """The prefill's token (None for a zero budget)."""
        return self.steps[0].target_token if self.steps and self.steps[0].committed else None

    def tokens(self) -> list[tuple[int, str]]:
        """Every generated (token id, kind), cut where the row stopped: the ids are the row's output."""
        return [pair for step in self.steps for pair in step.tokens()]

    @property
    def generated(self) -> int:
        return sum(step.committed for step in self.steps)

    @property
    def accepted(self) -> int:
        return sum(step.accepted for step in self.steps)

    @property
    def drafted(self) -> int:
        return sum(len(step.drafted) for step in self.steps)

    @property
    def tau(self) -> float:
        """Generated tokens per target pass (the prefill included), as `DecodeStats.tau` counts it."""
        return self.generated / len(self.steps) if self.steps else 0.0

    @property
    def seconds(self) -> float:
        """From the decode's start to the row's last step."""
        return self.steps[-1].time_s if self.steps else 0.0


@dataclass
class StepEvent:
    """What `on_step` receives after each step: `rows` (prompt indices), the (token id, kind) pairs
    each committed, and seconds since the decode started."""

    rows: list[int]
    tokens: list[list[tuple[int, str]]]
    time_s: float


@dataclass
class _Step:
    """One step's device tensors: `rows`, `lengths` (after the commit), `target` `[B]`; `draft`,
    `looked_up` `[B, gamma]` and `accepted` `[B]` (None without drafts)."""

    rows: torch.Tensor
    lengths: torch.Tensor
    target: torch.Tensor
    draft: torch.Tensor | None
    accepted: torch.Tensor | None
    looked_up: torch.Tensor | None
    time_s: float = 0.0


class Recorder:
    """Collects a decode's steps for `RowRecord`s and, with `on_step`, streams them."""

    def __init__(
        self, prompt_lengths: Sequence[int], start: float, on_step: Callable[[StepEvent], None] | None = None
    ) -> None:
        self.prompt_lengths = list(prompt_lengths)
        self.start = start
        self.on_step = on_step
        self.steps: list[_Step] = []
        # each row's committed length as last streamed (on_step only)
        self._streamed = list(self.prompt_lengths)

    def add(
        self,
        rows: torch.Tensor,
        lengths: torch.Tensor,
        target: torch.Tensor,
        draft: torch.Tensor | None = None,
        accepted: torch.Tensor | None = None,
        looked_up: torch.Tensor | None = None,
    ) -> None:
        """Keep one step's tensors (see `_Step`); no copy, no sync."""
        self.steps.append(_Step(rows, lengths, target, draft, accepted, looked_up))

    def synced(self) -> None:
        """After the loop's host sync of a step: time-stamp it and, with `on_step`, stream it."""
        self.steps[-1].time_s = time.perf_counter() - self.start
        if self.on_step is not None:
            ((rows, steps),) = _host_rows([self.steps[-1]], self._streamed)
            self.on_step(StepEvent(rows, [step.tokens() for step in steps], self.steps[-1].time_s))

    def rows(self) -> list[RowRecord]:
        """One `RowRecord` per prompt, in the caller's order (the tensors reach the host here)."""
        records = [RowRecord(n) for n in self.prompt_lengths]
        for rows, steps in _host_rows(self.steps, list(self.prompt_lengths)):
            for row, step in zip(rows, steps):
                records[row].steps.append(step)
        return records


def _host_rows(steps: list[_Step], lengths: list[int]) -> list[tuple[list[int], list[StepRecord]]]:
    """`steps` on the host in one transfer: per step, its rows and a `StepRecord` each; `lengths`, each
    row's committed length before the first step, is moved along with them."""
    parts: list[torch.Tensor] = []
    for s in steps:
        parts += [s.rows, s.lengths, s.target]
        if s.draft is not None:  # a step with drafts has their accepted counts (`_Step`)
            looked_up = s.looked_up if s.looked_up is not None else torch.zeros_like(s.draft, dtype=torch.bool)
            parts += [cast(torch.Tensor, s.accepted), s.draft.flatten(), looked_up.flatten()]
    flat = iter(torch.cat([p.long() for p in parts]).tolist() if parts else [])

    def take(n: int) -> list[int]:
        return list(itertools.islice(flat, n))

    out = []
    for s in steps:
        batch, gamma = s.rows.shape[0], 0 if s.draft is None else s.draft.shape[1]
        rows, after, target = take(batch), take(batch), take(batch)
        accepted = take(batch) if gamma else [0] * batch
        drafts = [take(gamma) for _ in range(batch)]
        looked = [[bool(x) for x in take(gamma)] for _ in range(batch)]
        records = []
        for b, row in enumerate(rows):
            records.append(StepRecord(drafts[b], accepted[b], target[b], looked[b], after[b] - lengths[row], s.time_s))
            lengths[row] = after[b]
        out.append((rows, records))
    return out
