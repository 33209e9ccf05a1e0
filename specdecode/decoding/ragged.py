"""The eager core's rows: a ragged batch whose finished rows leave it (`eager.py`'s loops).

When rows finish (an EOS id or their budget), their tokens are collected and they are dropped from
the batch and from every cache, so later passes are narrower.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from specdecode.decoding.record import Recorder
from specdecode.decoding.rows import RowState


class RaggedRows(RowState):
    """The eager core's rows; `rows` `[B]` is each one's index in the caller's prompt list, and
    finished rows leave (`keep`)."""

    def __init__(
        self, prompts: Sequence[Sequence[int]], budgets: list[int], slack: int, eos: Sequence[int], device: torch.device
    ) -> None:
        capacity = max(len(p) + b for p, b in zip(prompts, budgets)) + slack
        super().__init__(prompts, budgets, capacity, eos, device)
        self.rows = torch.arange(len(prompts), device=device)

    def keep(self, keep: torch.Tensor) -> None:
        self.tokens = self.tokens.index_select(0, keep)
        self.lengths = self.lengths.index_select(0, keep)
        self.limits = self.limits.index_select(0, keep)
        self.rows = self.rows.index_select(0, keep)


class SelectsRows(Protocol):
    """Per-row decode state (a KV cache, a drafting strategy) that finished rows leave."""

    def select_rows(self, rows: torch.Tensor) -> None: ...


class Finisher:
    """Collects finished rows' outputs and drops them from the batch and the caches."""

    def __init__(self, num_rows: int, recorder: Recorder | None = None) -> None:
        self.sequences: list[list[int] | None] = [None] * num_rows
        self.recorder = recorder

    def step(self, batch: RaggedRows, finished: torch.Tensor, caches: Sequence[SelectsRows]) -> int | None:
        """Between steps: retire finished rows; return the longest row's length, None once all are done.

        The one host sync of a step: which rows finished, and how long the longest row is (the
        recorder time-stamps the step there).
        """
        any_finished, max_length = torch.stack([finished.any().long(), batch.lengths.max()]).tolist()
        if self.recorder is not None:
            self.recorder.synced()
        if any_finished:
            self._collect(batch, finished, caches)
            if batch.rows.numel() == 0:
                return None
        return max_length

    def _collect(self, batch: RaggedRows, finished: torch.Tensor, caches: Sequence[SelectsRows]) -> None:
        done = finished.nonzero().squeeze(1)
        for b, row, length in zip(done.tolist(), batch.rows[done].tolist(), batch.lengths[done].tolist()):
            start = batch.prompt_lengths[row]
            self.sequences[row] = batch.tokens[b, start:length].tolist()
        keep = (~finished).nonzero().squeeze(1)
        batch.keep(keep)
        for cache in caches:
            cache.select_rows(keep)
