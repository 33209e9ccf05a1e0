"""The static core's state in a call: the rows it decodes, its counters on the device, and the
prompt lookup of its active rows. A compiled round or step writes the token rows and the counters
in place, so they come from the call's `Zeros` (`static_buffers`): at fixed addresses across calls."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.decoding.lookup import PromptLookup
from specdecode.decoding.rows import RowState
from specdecode.decoding.static_buffers import Zeros, fresh_zeros
from specdecode.decoding.stats import StepCounters


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


class DeviceCounters:
    """`StepCounters` kept on the device, counting only active rows (a step counts where any is)."""

    def __init__(self, gamma: int, device: torch.device, zeros: Zeros = fresh_zeros) -> None:
        self.gamma = gamma
        # target calls, target calls counted per row, and draft-verify steps counted per row
        self.calls = zeros("counters.calls", (3,), torch.long, device)
        self.histogram = zeros("counters.histogram", (gamma + 1,), torch.long, device)

    def record_target_call(self, active: torch.Tensor) -> None:
        self.calls[:2] += torch.stack([active.any().long(), active.sum()])

    def record_step(self, num_accepted: torch.Tensor, active: torch.Tensor) -> None:
        self.calls += torch.stack([active.any().long(), active.sum(), active.sum()])
        # scatter_add_ rather than bincount: bincount sizes its output from the data (a host sync)
        self.histogram.scatter_add_(0, num_accepted, active.long())

    def finish(
        self, drafter_calls_per_step: int, drafter_prefill_calls: int, looked_up: torch.Tensor | int
    ) -> StepCounters:
        """The eager loop's counters (one host sync)."""
        counters = StepCounters(self.gamma, self.histogram.device)
        calls, row_calls, row_steps = self.calls.tolist()
        counters.target_calls, counters.row_calls = calls, row_calls
        counters.drafter_calls = drafter_prefill_calls + drafter_calls_per_step * (calls - 1)
        counters.drafted = self.gamma * row_steps
        counters.histogram = self.histogram
        counters.looked_up = looked_up
        return counters


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
