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
        # the widest gamma of the decode's steps
        self.gamma = gamma
        self.target_calls = 0
        self.drafter_calls = 0
        # Target calls counted per row (a batched call of B rows counts B): tau's denominator.
        self.row_calls = 0
        self.drafted = 0
        # row-steps that ended in a rejection (fewer accepted than drafted)
        self.rejections = 0
        # histogram[n]: row-steps that accepted exactly n drafts.
        self.histogram = torch.zeros(gamma + 1, dtype=torch.long, device=device)
        # judged[i]: row-steps whose draft i was judged (drafts 0..i-1 accepted, i < the step's gamma)
        self.judged: list[int] = []
        # steps taken at each gamma (0: a target-only step of an adaptive decode)
        self.gamma_steps: dict[int, int] = {}
        # drafts that prompt lookup proposed (a device tensor, synced at the end)
        self.looked_up: torch.Tensor | int = 0

    def record_target_call(self, batch_size: int) -> None:
        self.target_calls += 1
        self.row_calls += batch_size


class DeviceCounters:
    """A decode's running counts, on the device (counting never syncs) in the call's `zeros` (a
    compiled step adds in place); only active rows count. `gamma` is the widest step's."""

    def __init__(self, gamma: int, device: torch.device, zeros: Zeros = fresh_zeros) -> None:
        self.gamma = gamma
        # target calls, target calls counted per row, draft-verify steps counted per row, drafts, rejections
        self.calls = zeros("counters.calls", (5,), torch.long, device)
        self.histogram = zeros("counters.histogram", (gamma + 1,), torch.long, device)
        self.judged = zeros("counters.judged", (gamma,), torch.long, device)
        # host-side: steps taken at each gamma (known to the host as it chooses them)
        self.gamma_steps: dict[int, int] = {}

    def record_target_call(self, active: torch.Tensor) -> None:
        self.calls[:2] += torch.stack([active.any().long(), active.sum()])

    def record_step(
        self,
        num_accepted: torch.Tensor,
        active: torch.Tensor,
        gamma: int | None = None,
        judged: torch.Tensor | None = None,
    ) -> None:
        """A verify step of `gamma` drafts (default `self.gamma`) over the `active` rows `[B]` bool,
        each accepting `num_accepted` `[B]`; only `judged` rows' drafts count (None: all)."""
        gamma = self.gamma if gamma is None else gamma
        judged = active if judged is None else active & judged
        rows = judged.sum()
        rejected = (judged & (num_accepted < gamma)).sum()
        self.calls += torch.stack([active.any().long(), active.sum(), rows, gamma * rows, rejected])
        # scatter_add_ rather than bincount: bincount sizes its output from the data (a host sync)
        self.histogram.scatter_add_(0, num_accepted, judged.long())
        position = torch.arange(gamma, device=num_accepted.device)
        self.judged[:gamma] += ((num_accepted.unsqueeze(1) >= position) & judged.unsqueeze(1)).sum(dim=0)

    def finish(self, looked_up: torch.Tensor | None = None) -> StepCounters:
        """The counts as `StepCounters` (one host sync); `looked_up`: the drafting's count, None without a drafter."""
        counters = StepCounters(self.gamma, self.histogram.device)
        calls, row_calls, _, drafted, rejections = self.calls.tolist()
        counters.target_calls, counters.row_calls = calls, row_calls
        # the drafter's prefill, then a call per draft: `gamma` per step unless it was chosen per step
        steps = self.gamma_steps.items() if self.gamma_steps else [(self.gamma, calls - 1)]
        counters.drafter_calls = 0 if looked_up is None else 1 + sum(g * n for g, n in steps)
        counters.drafted, counters.rejections = drafted, rejections
        counters.histogram = self.histogram
        counters.judged = self.judged.tolist()
        counters.gamma_steps = dict(sorted(self.gamma_steps.items()))
        counters.looked_up = 0 if looked_up is None else looked_up
        return counters


@dataclass
class DecodeStats:
    """Summary of one `speculative_generate` / `autoregressive_generate` call.

    alpha: the maximum-likelihood per-token acceptance A / (A + R), A accepted drafts and R steps
    ending in a rejection (accepted / drafted would understate it: drafts after a rejection are never
    judged). tau: generated tokens per target call per row (prefill included). position_acceptance[i]
    = P(draft i accepted | drafts before it accepted). looked_up: drafts prompt lookup proposed.
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
    # steps taken at each gamma where it was chosen per step (`gamma="auto"`; 0: target-only steps); {} else
    gamma_steps: dict[int, int] = field(default_factory=dict)
    # judged[i]: row-steps whose draft i was judged (position_acceptance's denominators)
    judged: list[int] = field(default_factory=list)

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
        rejections = counters.rejections
        # of the steps that judged draft i, those that accepted more than i passed it
        judged = counters.judged or [0] * gamma
        passed = [sum(histogram[i + 1 :]) for i in range(gamma)]
        position_acceptance = [passed[i] / judged[i] if judged[i] else None for i in range(gamma)]
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
            gamma_steps=counters.gamma_steps,
            judged=judged,
        )
        return cls(sequences=sequences, stats=stats)

    @classmethod
    def empty(cls, prompts: Sequence[Sequence[int]], counters: StepCounters, record: bool) -> GenerationResult:
        """The result of a decode whose every budget is 0 (no model call); empty records if asked."""
        result = cls.build([[] for _ in prompts], counters, 0.0)
        result.record = [RowRecord(len(p)) for p in prompts] if record else None
        return result
