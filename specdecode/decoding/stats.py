"""What a decode run did: calls, acceptance, throughput."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from specdecode.decoding.record import RowRecord
from specdecode.decoding.static_buffers import Zeros, fresh_zeros


class StepCounters:
    """The counts of a decode, as `GenerationResult.build` reads them (`DeviceCounters.finish`)."""

    def __init__(self, gamma: int, device: torch.device) -> None:
        self.gamma = gamma
        self.target_calls = 0
        self.drafter_calls = 0
        # Target calls counted per row (a batched call of B rows counts B): tau's denominator.
        self.row_calls = 0
        self.drafted = 0
        # histogram[n]: row-steps that accepted exactly n of the gamma drafts.
        self.histogram = torch.zeros(gamma + 1, dtype=torch.long, device=device)
        # drafts that prompt lookup proposed instead of the drafter (a device tensor: never synced
        # before the end)
        self.looked_up: torch.Tensor | int = 0

    def record_target_call(self, batch_size: int) -> None:
        self.target_calls += 1
        self.row_calls += batch_size


class DeviceCounters:
    """A decode's running counts, kept on the device so that counting a step never syncs; only
    active rows count (a step counts where any is). A compiled step adds to them in place, so
    they come from the call's `zeros`."""

    def __init__(self, gamma: int, device: torch.device, zeros: Zeros = fresh_zeros) -> None:
        self.gamma = gamma
        # target calls, target calls counted per row, and draft-verify steps counted per row
        self.calls = zeros("counters.calls", (3,), torch.long, device)
        self.histogram = zeros("counters.histogram", (gamma + 1,), torch.long, device)

    def record_target_call(self, active: torch.Tensor) -> None:
        self.calls[:2] += torch.stack([active.any().long(), active.sum()])

    def record_step(self, num_accepted: torch.Tensor, active: torch.Tensor, judged: torch.Tensor | None = None) -> None:
        """A verify step over the `active` rows `[B]` bool, of which `judged` (None: all) drafted:
        only their drafts count as drafted, accepted or rejected."""
        judged = active if judged is None else active & judged
        self.calls += torch.stack([active.any().long(), active.sum(), judged.sum()])
        # scatter_add_ rather than bincount: bincount sizes its output from the data (a host sync)
        self.histogram.scatter_add_(0, num_accepted, judged.long())

    def finish(
        self, drafter_calls_per_step: int, drafter_prefill_calls: int, looked_up: torch.Tensor | int
    ) -> StepCounters:
        """The counts as `StepCounters` (one host sync)."""
        counters = StepCounters(self.gamma, self.histogram.device)
        calls, row_calls, row_steps = self.calls.tolist()
        counters.target_calls, counters.row_calls = calls, row_calls
        counters.drafter_calls = drafter_prefill_calls + drafter_calls_per_step * (calls - 1)
        counters.drafted = self.gamma * row_steps
        counters.histogram = self.histogram
        counters.looked_up = looked_up
        return counters


@dataclass
class DecodeStats:
    """Summary of one `speculative_generate` / `autoregressive_generate` call.

    alpha is the maximum-likelihood per-token acceptance rate A / (A + R), A accepted drafts and R
    steps that ended in a rejection (under i.i.d. acceptance a step's count is a geometric number of
    successes, truncated at gamma); accepted / drafted would understate it, because drafts after the
    first rejection are never judged. tau is generated tokens per target call per row (prefill
    included; a batched call over B rows counts B), 1 for autoregressive decoding.
    position_acceptance[i] = P(draft i accepted | drafts before it accepted). looked_up counts the
    drafts that prompt lookup (`specdecode.decoding.lookup`) proposed instead of the drafter.
    """

    gamma: int
    target_calls: int
    drafter_calls: int
    drafted: int
    accepted: int
    rejections: int
    alpha: float | None
    tau: float
    position_acceptance: list[float | None]
    accepted_length_histogram: list[int]
    generated_tokens: int
    wall_time_s: float
    tokens_per_s: float
    looked_up: int = 0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class GenerationResult:
    """`sequences[i]`: the ids generated for prompt i (EOS included when hit), `stats`: see DecodeStats,
    `features`: the target's features per prompt when asked for (`autoregressive_generate`),
    `record`: how each token came, per prompt, when asked for (`specdecode.decoding.record`)."""

    sequences: list[list[int]]
    stats: DecodeStats = field(repr=False)
    features: list[torch.Tensor] | None = field(default=None, repr=False)
    record: list[RowRecord] | None = field(default=None, repr=False)

    @classmethod
    def build(cls, rows: Sequence[list[int] | None], counters: StepCounters, wall_time_s: float) -> GenerationResult:
        sequences = [s for s in rows if s is not None]
        assert len(sequences) == len(rows), "every row must finish"
        histogram = counters.histogram.tolist()
        gamma = counters.gamma
        accepted = sum(n * count for n, count in enumerate(histogram))
        rejections = sum(histogram[:gamma])
        # reached[i]: steps whose drafts 0..i-1 were all accepted, so draft i was judged.
        reached = [sum(histogram[i:]) for i in range(gamma)]
        position_acceptance = [
            (reached[i + 1] if i + 1 < gamma else histogram[gamma]) / reached[i] if reached[i] else None
            for i in range(gamma)
        ]
        generated = sum(len(s) for s in sequences)
        stats = DecodeStats(
            gamma=gamma,
            target_calls=counters.target_calls,
            drafter_calls=counters.drafter_calls,
            drafted=counters.drafted,
            accepted=accepted,
            rejections=rejections,
            alpha=accepted / (accepted + rejections) if gamma and accepted + rejections else None,
            tau=generated / counters.row_calls if counters.row_calls else 0.0,
            position_acceptance=position_acceptance,
            accepted_length_histogram=histogram,
            generated_tokens=generated,
            wall_time_s=wall_time_s,
            tokens_per_s=generated / wall_time_s if wall_time_s > 0 else 0.0,
            looked_up=int(counters.looked_up),
        )
        return cls(sequences=sequences, stats=stats)

    @classmethod
    def empty(cls, prompts: Sequence[Sequence[int]], counters: StepCounters, record: bool) -> GenerationResult:
        """The result of a decode whose every budget is 0 (no model call); empty records if asked."""
        result = cls.build([[] for _ in prompts], counters, 0.0)
        result.record = [RowRecord(len(p)) for p in prompts] if record else None
        return result
