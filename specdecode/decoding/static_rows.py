"""The static core's state in a call: the rows it decodes, its counters on the device, and the
prompt lookup of its active rows. A compiled round or step writes the token rows and the counters
in place, so they come from the call's `Zeros` (`static_buffers`): at fixed addresses across calls."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.decoding.cache import padded_prompts
from specdecode.decoding.drafting import last_tokens
from specdecode.decoding.lookup import PromptLookup
from specdecode.decoding.ragged import kept_counts
from specdecode.decoding.static_buffers import Zeros, fresh_zeros
from specdecode.decoding.static_cache import rows_capacity
from specdecode.decoding.stats import StepCounters


@dataclass
class Rows:
    """Committed tokens `[B, S_cap]`, lengths / limits `[B]` (limit = prompt length + budget) and
    which rows are still decoding, `active` `[B]` bool. Rows never leave: a finished one is masked."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    limits: torch.Tensor
    active: torch.Tensor
    prompt_lengths: list[int]
    eos: torch.Tensor

    @classmethod
    def from_prompts(
        cls,
        prompts: Sequence[Sequence[int]],
        budgets: list[int],
        gamma: int | None,
        eos: Sequence[int],
        device: torch.device,
        capacity: int | None = None,
        zeros: Zeros = fresh_zeros,
    ) -> Rows:
        """The rows of `prompts`, their token buffer from `zeros` (default: a new one)."""
        prompt_lengths = [len(p) for p in prompts]
        capacity = rows_capacity(prompts, budgets, gamma, capacity)
        tokens, lengths, limits = padded_prompts(prompts, budgets, capacity)
        buffer = zeros("rows.tokens", tuple(tokens.shape), torch.long, device)
        return cls(
            buffer.copy_(tokens),
            lengths.to(device),
            limits.to(device),
            (lengths < limits).to(device),
            prompt_lengths,
            torch.tensor(sorted(set(eos)), dtype=torch.long, device=device),
        )

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    def last(self, n: int) -> torch.Tensor:
        """The last `n` committed tokens of each row, `[B, n]`."""
        return last_tokens(self.tokens, self.lengths, n)

    def commit(self, new_tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Append the first `counts[b]` of `new_tokens` `[B, W]` to each active row, cut at EOS and
        budget (`ragged.kept_counts`); a row that hits either stops being active."""
        counts = torch.where(self.active, counts, 0)
        counts, hit_eos = kept_counts(new_tokens, counts, self.eos, self.limits - self.lengths)
        # All W entries are written (one scatter); those past the new length are never read as committed.
        offsets = torch.arange(new_tokens.shape[1], device=new_tokens.device)
        self.tokens.scatter_(1, self.lengths.unsqueeze(1) + offsets, new_tokens)
        self.lengths = self.lengths + counts
        self.active = self.active & ~hit_eos & (self.lengths < self.limits)

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
