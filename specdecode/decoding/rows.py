"""The rows a decode writes and the one commit rule of both cores: the eager core's rows leave the
batch when they finish (`RaggedRows`); the static core's stay, masked (`StaticRows`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specdecode.decoding.cache import KVCache, cached_forward_features
from specdecode.decoding.static_buffers import Zeros, fresh_zeros


def last_tokens(tokens: torch.Tensor, lengths: torch.Tensor, n: int) -> torch.Tensor:
    """The last `n` committed tokens of each row, `[B, n]`."""
    return tokens.gather(1, lengths.unsqueeze(1) - n + torch.arange(n, device=tokens.device))


class RowState:
    """Committed tokens `[B, S_cap]`, lengths / limits `[B]` (limit = prompt length + budget) and the EOS ids."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        budgets: Sequence[int],
        capacity: int,
        eos: Sequence[int],
        device: torch.device,
        zeros: Zeros = fresh_zeros,
    ) -> None:
        tokens = torch.zeros(len(prompts), capacity, dtype=torch.long)  # on the CPU: one copy to the device
        for i, prompt in enumerate(prompts):
            tokens[i, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        self.tokens = zeros("rows.tokens", tuple(tokens.shape), torch.long, device).copy_(tokens)
        self.prompt_lengths = [len(p) for p in prompts]
        self.lengths = torch.tensor(self.prompt_lengths, dtype=torch.long, device=device)
        self.limits = self.lengths + torch.tensor(list(budgets), dtype=torch.long, device=device)
        self.eos = torch.tensor(sorted(set(eos)), dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    def last(self, n: int) -> torch.Tensor:
        """The last `n` committed tokens of each row, `[B, n]`."""
        return last_tokens(self.tokens, self.lengths, n)

    def commit(self, new_tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The one commit rule: append `new_tokens[b, :counts[b]]` `[B, W]` to each row, cut after its
        first EOS id and at its budget → whether each row finished `[B]` bool."""
        offsets = torch.arange(new_tokens.shape[1], device=new_tokens.device)
        is_eos = (offsets < counts.unsqueeze(1)) & torch.isin(new_tokens, self.eos)
        hit_eos = is_eos.any(dim=1)
        counts = torch.minimum(
            torch.where(hit_eos, is_eos.long().argmax(dim=1) + 1, counts), self.limits - self.lengths
        )
        # All W entries are written (one scatter); those past the new length are never read as committed.
        self.tokens.scatter_(1, self.lengths.unsqueeze(1) + offsets, new_tokens)
        self.lengths = self.lengths + counts
        return hit_eos | (self.lengths >= self.limits)


class RaggedRows(RowState):
    """The eager core's rows; `rows` `[B]` is each one's prompt index; finished rows leave (`keep`)."""

    def __init__(
        self, prompts: Sequence[Sequence[int]], budgets: list[int], slack: int, eos: Sequence[int], device: torch.device
    ) -> None:
        capacity = max(len(p) + b for p, b in zip(prompts, budgets)) + slack
        super().__init__(prompts, budgets, capacity, eos, device)
        self.rows = torch.arange(len(prompts), device=device)

    def fan_out(self, n: int) -> torch.Tensor:
        """Each row becomes `n` rows in its place (row i → i * n .. i * n + n - 1), numbered anew →
        the old row of each new one `[B * n]`, for the caches' `select_rows`. Before any row left."""
        index = torch.arange(len(self.prompt_lengths), device=self.lengths.device).repeat_interleave(n)
        self.keep(index)
        self.prompt_lengths = [length for length in self.prompt_lengths for _ in range(n)]
        self.rows = torch.arange(index.numel(), device=index.device)
        return index

    def keep(self, keep: torch.Tensor) -> None:
        self.tokens = self.tokens.index_select(0, keep)
        self.lengths = self.lengths.index_select(0, keep)
        self.limits = self.limits.index_select(0, keep)
        self.rows = self.rows.index_select(0, keep)


class StaticRows(RowState):
    """The static core's rows, and which are still decoding, `active` `[B]` bool; finished ones are masked."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        budgets: list[int],
        capacity: int,
        eos: Sequence[int],
        device: torch.device,
        zeros: Zeros = fresh_zeros,
    ) -> None:
        super().__init__(prompts, budgets, capacity, eos, device, zeros)
        self.active = self.lengths < self.limits

    def commit(self, new_tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """A row that finishes stops being active; a masked row commits nothing."""
        self.active = self.active & ~super().commit(new_tokens, torch.where(self.active, counts, 0))
        return ~self.active

    def sequences(self) -> list[list[int]]:
        """Each row's generated tokens (one host sync)."""
        tokens, lengths = self.tokens.tolist(), self.lengths.tolist()
        return [row[start:length] for row, start, length in zip(tokens, self.prompt_lengths, lengths)]


def prefill(
    model: PreTrainedModel, cache: KVCache, rows: RowState, feature_layers: tuple[int, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cache the prompts → logits at each row's last prompt token `[B, V]`, features `[B, T, n·H]`."""
    longest = max(rows.prompt_lengths)
    last = rows.lengths - 1
    # Ask only for the positions some row ends at (a handful), not the whole prompt's logits.
    positions = torch.unique(last)
    logits, hidden = cached_forward_features(
        model, cache, rows.tokens[:, :longest], logits_to_keep=positions, feature_layers=feature_layers
    )
    cache.set_lengths(rows.lengths.clone(), longest)
    column = torch.searchsorted(positions, last)
    return logits[torch.arange(len(last), device=last.device), column], hidden


class FeatureRows:
    """The target's features of every token a target-only decode read: `values` `[B, S_cap, n·H]`."""

    def __init__(self, prompt_features: torch.Tensor, capacity: int, zeros: Zeros = fresh_zeros) -> None:
        batch, longest, width = prompt_features.shape
        self.values = zeros("features.written", (batch, capacity, width), prompt_features.dtype, prompt_features.device)
        self.values[:, :longest] = prompt_features

    def write(self, rows: torch.Tensor, positions: torch.Tensor, features: torch.Tensor) -> None:
        """Row `rows[b]`'s token at `positions[b]` has features `features[b]` `[B', n·H]`."""
        self.values[rows, positions] = features

    def rows(self, prompt_lengths: Sequence[int], sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """`[P_i + R_i, n·H]` per row; the last generated token's row (never fed) is zero."""
        out = []
        for i, (length, generated) in enumerate(zip(prompt_lengths, sequences)):
            row = self.values[i, : length + len(generated)].clone()
            if generated:
                row[-1] = 0
            out.append(row)
        return out
