"""The eager core's rows: a ragged batch whose finished rows leave it (`decode.py`'s loops).

Between steps, per row: `tokens[:length]` are committed (prompt + generated); the target cache
holds all but the last committed token (the "pending" one, fed in the next pass). When rows finish
(an EOS id or their budget), their tokens are collected and they are dropped from the batch and
from every cache, so later passes are narrower.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from specdecode.decoding.cache import RaggedKVCache, cached_forward, padded_prompts
from specdecode.decoding.drafting import last_tokens
from specdecode.decoding.record import Recorder


def kept_counts(
    new_tokens: torch.Tensor, counts: torch.Tensor, eos: torch.Tensor, room: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The commit rule of both cores: of the first `counts[b]` of `new_tokens` `[B, W]`, a row keeps
    those up to and including its first EOS id (`eos`, sorted), at most `room[b]` (its budget left).

    Returns:
        The kept counts `[B]` and whether each row hit an EOS id `[B]` bool.
    """
    offsets = torch.arange(new_tokens.shape[1], device=new_tokens.device)
    is_eos = (offsets < counts.unsqueeze(1)) & torch.isin(new_tokens, eos)
    hit_eos = is_eos.any(dim=1)
    counts = torch.where(hit_eos, is_eos.long().argmax(dim=1) + 1, counts)
    return torch.minimum(counts, room), hit_eos


@dataclass
class Batch:
    """Committed tokens and per-row bookkeeping of the rows still being decoded.

    tokens `[B, S_cap]`, lengths / limits `[B]` (limit = prompt length + budget), rows `[B]` (index
    of each row in the caller's prompt list).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    limits: torch.Tensor
    rows: torch.Tensor
    prompt_lengths: list[int]
    eos: torch.Tensor

    @classmethod
    def from_prompts(
        cls, prompts: Sequence[Sequence[int]], budgets: list[int], slack: int, eos: Sequence[int], device: torch.device
    ) -> Batch:
        prompt_lengths = [len(p) for p in prompts]
        capacity = max(n + b for n, b in zip(prompt_lengths, budgets)) + slack
        tokens, lengths, limits = padded_prompts(prompts, budgets, capacity)
        return cls(
            tokens.to(device),
            lengths.to(device),
            limits.to(device),
            torch.arange(len(prompts), device=device),
            prompt_lengths,
            torch.tensor(sorted(set(eos)), dtype=torch.long, device=device),
        )

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    def last(self, n: int) -> torch.Tensor:
        """The last `n` committed tokens of each row, `[B, n]`."""
        return last_tokens(self.tokens, self.lengths, n)

    def commit(self, new_tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Append the first `counts[b]` of `new_tokens` `[B, W]` to each row, cut at EOS and budget.

        Returns `finished` `[B]` bool: the row hit an EOS id or its budget.
        """
        counts, hit_eos = kept_counts(new_tokens, counts, self.eos, self.limits - self.lengths)
        # Entries past the new length are written too but never read as committed: writing all W
        # keeps this a single scatter.
        offsets = torch.arange(new_tokens.shape[1], device=new_tokens.device)
        self.tokens.scatter_(1, self.lengths.unsqueeze(1) + offsets, new_tokens)
        self.lengths = self.lengths + counts
        return hit_eos | (self.lengths >= self.limits)

    def keep(self, keep: torch.Tensor) -> None:
        self.tokens = self.tokens.index_select(0, keep)
        self.lengths = self.lengths.index_select(0, keep)
        self.limits = self.limits.index_select(0, keep)
        self.rows = self.rows.index_select(0, keep)


def prefill(
    model: PreTrainedModel, cache: RaggedKVCache, batch: Batch, feature_layers: tuple[int, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cache the right-padded prompts; return the logits at each row's last prompt token `[B, V]`
    and, with `feature_layers`, the drafter's features of all prompt positions `[B, T, n·H]`."""
    longest = max(batch.prompt_lengths)
    last = batch.lengths - 1
    # Ask only for the positions some row ends at (a handful), not the whole prompt's logits.
    positions = torch.unique(last)
    out = cached_forward(
        model, cache, batch.tokens[:, :longest], logits_to_keep=positions, feature_layers=feature_layers
    )
    logits, hidden = out if feature_layers is not None else (out, None)
    cache.set_lengths(batch.lengths.clone(), longest)
    column = torch.searchsorted(positions, last)
    return logits[torch.arange(len(last), device=last.device), column], hidden


class RowState(Protocol):
    """Per-row decode state (a KV cache, a drafting strategy) that finished rows leave."""

    def select_rows(self, rows: torch.Tensor) -> None: ...


class Finisher:
    """Collects finished rows' outputs and drops them from the batch and the caches."""

    def __init__(self, num_rows: int, recorder: Recorder | None = None) -> None:
        self.sequences: list[list[int] | None] = [None] * num_rows
        self.recorder = recorder

    def step(self, batch: Batch, finished: torch.Tensor, caches: Sequence[RowState]) -> int | None:
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

    def _collect(self, batch: Batch, finished: torch.Tensor, caches: Sequence[RowState]) -> None:
        done = finished.nonzero().squeeze(1)
        for b, row, length in zip(done.tolist(), batch.rows[done].tolist(), batch.lengths[done].tolist()):
            start = batch.prompt_lengths[row]
            self.sequences[row] = batch.tokens[b, start:length].tolist()
        keep = (~finished).nonzero().squeeze(1)
        batch.keep(keep)
        for cache in caches:
            cache.select_rows(keep)


class FeatureRows:
    """The target's features of every token a target-only decode read, per row of the caller's
    prompt list: `[B, S_cap, n·H]`, written in place (no host sync), cut per row at the end."""

    def __init__(self, prompt_features: torch.Tensor, capacity: int) -> None:
        batch, longest, width = prompt_features.shape
        self.values = prompt_features.new_zeros(batch, capacity, width)
        self.values[:, :longest] = prompt_features

    def write(self, rows: torch.Tensor, positions: torch.Tensor, features: torch.Tensor) -> None:
        """Row `rows[b]`'s token at `positions[b]` has features `features[b]` `[B', n·H]`."""
        self.values[rows, positions] = features

    def rows(self, prompt_lengths: Sequence[int], sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """`[P_i + R_i, n·H]` per row; the last generated token's row (never fed) is zero. Past a
        row's prompt the prefill wrote other rows' padding, which every fed token overwrote."""
        out = []
        for i, (length, generated) in enumerate(zip(prompt_lengths, sequences)):
            row = self.values[i, : length + len(generated)].clone()
            if generated:
                row[-1] = 0
            out.append(row)
        return out
