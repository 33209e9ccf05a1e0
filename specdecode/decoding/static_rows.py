"""The static core's state in a call: the rows it decodes and the prompt lookup of its active rows.
A compiled round or step writes the token rows in place, so they come from the call's `Zeros`
(`static_buffers`): at fixed addresses across calls."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.decoding.lookup import PromptLookup
from specdecode.decoding.rows import RowState
from specdecode.decoding.static_buffers import Zeros, fresh_zeros


class StaticRows(RowState):
    """The static core's rows, and which are still decoding, `active` `[B]` bool. Rows never leave:
    a finished one is masked."""

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
        """`RowState.commit` for the active rows alone; a row that finishes stops being active."""
        self.active = self.active & ~super().commit(new_tokens, torch.where(self.active, counts, 0))
        return ~self.active

    def sequences(self) -> list[list[int]]:
        """Each row's generated tokens (one host sync)."""
        tokens, lengths = self.tokens.tolist(), self.lengths.tolist()
        return [row[start:length] for row, start, length in zip(tokens, self.prompt_lengths, lengths)]


class ActiveRowsLookup:
    """A `PromptLookup` that only the active rows use, so a masked row's drafts are never counted as
    looked up (the drafting strategies call `choose` alone)."""

    def __init__(self, lookup: PromptLookup) -> None:
        self.lookup = lookup
        self.active: torch.Tensor | None = None

    def choose(
        self, logits: torch.Tensor, drafts: torch.Tensor, context: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, used = self.lookup.choose(logits, drafts, context, lengths)
        used = used & self.active
        return torch.where(used, chosen, drafts), used
