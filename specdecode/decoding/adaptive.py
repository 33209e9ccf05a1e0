"""Gamma chosen while decoding (`gamma="auto"`): each step, the eager loop drafts the gamma (0: a
target step) of the most expected tokens per second for the batch as it is now, from the measured
step costs (`costs.StepTable`) and each row's acceptance, tracked as decayed counts of accepted
drafts A and rejections R around a prior alpha_0:

    alpha_b = (A_b + w_b * alpha_0) / (A_b + R_b + w_b).

The counts and the prior's weight w_b decay by `decay` each drafting step (a row never accepted
is estimated near 0, not held up by the prior); on target steps the counts decay by `idle_decay`
and w_b returns towards `prior_weight` (drifting back to the prior, so drafting is tried again).
A row expects min((1 - alpha^(g+1)) / (1 - alpha), its budget left) tokens at gamma g. The choice
uses only what happened before the step, so decoding stays exact (Leviathan et al. 2023, Thm 3.5);
its sums ride on the loop's one host sync per step.

With `calibrate`, the loop times each step between its syncs and scales the table by running
ratios of measured to predicted seconds, one for target steps and one for drafting steps (the
table leaves out lookup, catch-up, bookkeeping, load, and a mixed batch's splitting of its rows);
only their ratio moves the choice, target steps not yet timed counting as the table says. The
table is one noisy measurement, so a calibrated decode drafts once where the table puts drafting
within `PROBE_SHARE` of a target step's rate, and lets its own step times decide from then on. A
seeded sampled decode's gammas, and so its tokens, can then differ between runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.core.config import is_int
from specdecode.decoding.costs import StepTable

# The prior's weight in drafts: how many steps of evidence it takes to move a row's estimate.
PRIOR_WEIGHT = 2.0
# Each drafting step keeps this share of a row's evidence: the last ~10 steps count.
DECAY = 0.9
# Each target-only step keeps this share: back at the prior over ~100 steps, so drafting is retried.
IDLE_DECAY = 0.99
# A drafter's acceptance where it states none (`config.specdecode_alpha`).
DEFAULT_PRIOR_ALPHA = 0.5
# Each timed step moves the measured/predicted ratio of its kind (target or drafting step) this far.
CALIBRATION_WEIGHT = 0.2
# Drafting steps are weighed at most this much cheaper or dearer, against target steps, than the table says.
CALIBRATION_BOUNDS = (0.5, 2.0)
# A calibrated decode times a drafting step before trusting a table that puts drafting's best rate at
# or above this share of a target step's (leaving after `leave_after` target steps where it was right).
PROBE_SHARE = 0.75
# Estimates stop short of 1, where the expected tokens (1 - alpha^(g+1)) / (1 - alpha) are g + 1.
_MAX_ALPHA = 0.999


@dataclass(frozen=True)
class AdaptiveGamma:
    """Gamma chosen per step from `costs` (module docstring); `prior_alpha` is each row's
    acceptance before it has drafted, `max_gamma` the widest step (at most the table's).
    `drafter_costs`: in a mixed batch, drafter k's table (its drafts timed apart), so each drafter
    pays its own drafts for its rows (`seconds`). `calibrate`: scale the table by the decode's own
    step times (module docstring). `leave_after`: after this many target steps in a row, the target
    decodes alone to the end, without the speculative loop's work for the drafter (None: never)."""

    costs: StepTable
    prior_alpha: float = DEFAULT_PRIOR_ALPHA
    max_gamma: int | None = None
    prior_weight: float = PRIOR_WEIGHT
    decay: float = DECAY
    idle_decay: float = IDLE_DECAY
    drafter_costs: tuple[StepTable, ...] = ()
    calibrate: bool = False
    leave_after: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.costs, StepTable):
            raise TypeError(f"costs must be a StepTable (costs.step_table), got {self.costs!r}")
        if not 0.0 <= self.prior_alpha <= 1.0:
            raise ValueError(f"prior_alpha must be in [0, 1], got {self.prior_alpha!r}")
        widest = self.costs.max_gamma
        if self.max_gamma is not None and not (isinstance(self.max_gamma, int) and 1 <= self.max_gamma <= widest):
            raise ValueError(f"max_gamma must be an int in [1, {widest}] (the costs' widest), got {self.max_gamma!r}")
        if not self.prior_weight > 0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight!r}")
        for name in ("decay", "idle_decay"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if not isinstance(self.calibrate, bool):
            raise ValueError(f"calibrate must be True or False, got {self.calibrate!r}")
        if self.leave_after is not None and not (is_int(self.leave_after) and self.leave_after >= 1):
            raise ValueError(f"leave_after must be an int >= 1 or None, got {self.leave_after!r}")
        tables = (self.costs, *self.drafter_costs) if self.drafter_costs else ()
        if any(not isinstance(t, StepTable) or not t.drafts or t.max_gamma < self.widest for t in tables):
            raise ValueError(
                f"drafter_costs must be StepTables timing drafts apart, as costs does, up to gamma {self.widest}, "
                f"got {self.drafter_costs!r} beside costs {self.costs!r}"
            )

    @property
    def widest(self) -> int:
        return self.costs.max_gamma if self.max_gamma is None else self.max_gamma

    def fixed_gamma(self, batch_size: int) -> int:
        """One gamma for a whole decode of `batch_size` rows at the prior (a static decoder)."""
        return self._best(self._expected([self.prior_alpha] * batch_size), batch_size, None)

    def opening_gamma(
        self, priors: Sequence[float], budgets: Sequence[int] | None = None, groups: Sequence[int] | None = None
    ) -> int:
        """The first step's gamma for rows starting at `priors` with `budgets` tokens left (None: no
        cap; `groups` as `seconds`); 0: no draft pays at the rows' stated acceptance, so the target
        decodes alone. Calibrated, it drafts where the table is close (`probe_gamma`)."""
        expected = self._expected(priors, budgets)
        best = self._best(expected, len(priors), groups)
        return self.probe_gamma(expected, len(priors), groups) if best == 0 and self.calibrate else best

    def _expected(self, priors: Sequence[float], budgets: Sequence[int] | None = None) -> list[float]:
        rows = budgets if budgets is not None else [None] * len(priors)
        expected = [0.0] * (self.widest + 1)
        for prior, room in zip(priors, rows):
            alpha = min(prior, _MAX_ALPHA)
            for g in range(self.widest + 1):
                tokens = (1 - alpha ** (g + 1)) / (1 - alpha)
                expected[g] += tokens if room is None else min(tokens, room)
        return expected

    def choose(self, expected: list[float], batch_size: int, groups: Sequence[int] | None = None) -> int:
        """The gamma of the most `expected` tokens (per gamma 0..widest, over the batch) per second
        of a step of `batch_size` rows (`seconds`); ties: the shorter drafts."""
        return self._best(expected, batch_size, groups)

    def probe_gamma(self, expected: list[float], batch_size: int, groups: Sequence[int] | None = None) -> int:
        """The drafting gamma of the most tokens per second (as `choose`) where its rate is at least
        `PROBE_SHARE` of a target step's, else 0."""
        rates = self._rates(expected, batch_size, groups)
        drafting = max(range(1, len(rates)), key=lambda g: (rates[g], -g))
        return drafting if rates[drafting] >= PROBE_SHARE * rates[0] else 0

    def _rates(self, expected: list[float], batch_size: int, groups: Sequence[int] | None) -> list[float]:
        seconds = self.seconds(batch_size, groups)
        return [expected[g] / seconds[g] for g in range(self.widest + 1)]

    def _best(self, expected: list[float], batch_size: int, groups: Sequence[int] | None) -> int:
        rates = self._rates(expected, batch_size, groups)
        return max(range(len(rates)), key=lambda g: (rates[g], -g))

    def seconds(self, batch_size: int, groups: Sequence[int] | None = None) -> list[float]:
        """Seconds of a step of each gamma 0..G at `batch_size` rows. With `drafter_costs` and
        `groups` (rows per drafter of a mixed batch, in their order): the target's verify of the
        whole batch plus each drafter's drafts at its own rows; else `costs` alone."""
        whole = self.costs.at(batch_size)
        if not self.drafter_costs or groups is None:
            return whole
        seconds = [s - d for s, d in zip(whole, self.costs.drafts_at(batch_size))]
        for table, rows in zip(self.drafter_costs, groups):
            if rows:
                seconds = [s + d for s, d in zip(seconds, table.drafts_at(rows))]
        return [max(s, 1e-9) for s in seconds]

    def start(self, rows: int, device: torch.device, prior: torch.Tensor | None = None) -> GammaState:
        """The running state of a decode of `rows` rows; `prior` `[rows]`: each row's own prior
        acceptance (default: `prior_alpha` for all)."""
        if prior is None:
            prior = torch.full((rows,), self.prior_alpha, device=device)
        return GammaState(self, prior.to(device=device, dtype=torch.float32))


class GammaState:
    """One decode's per-row evidence `[B]` (accepted, rejections: decayed counts), prior `[B]` and
    the prior's weight `[B]` (module docstring)."""

    def __init__(self, policy: AdaptiveGamma, prior: torch.Tensor) -> None:
        self.policy = policy
        self.prior = prior
        self.accepted = torch.zeros_like(prior)
        self.rejections = torch.zeros_like(prior)
        self.weight = torch.full_like(prior, policy.prior_weight)
        self.gammas = torch.arange(policy.widest + 1, device=prior.device, dtype=torch.float32)
        # running measured / predicted seconds of target steps and of drafting steps (None: none timed
        # yet), and the step under way: (its kind, its predicted seconds, when it started)
        self.scale: list[float | None] = [None, None]
        self._timing: tuple[int, float, float] | None = None
        self._target_run = 0  # target steps chosen in a row

    def leaves(self) -> bool:
        """Whether the decode leaves the speculative loop (`AdaptiveGamma.leave_after`)."""
        after = self.policy.leave_after
        return after is not None and self._target_run >= after

    def relative(self) -> float:
        """How much dearer drafting steps run against the table than target steps do: the ratio of
        the two kinds' `scale`, within `CALIBRATION_BOUNDS`; 1 until drafting is timed. Target steps
        not yet timed count as the table says, so drafting timed dear first turns the choice to a
        target step, whose timing then tells a slow machine (both kinds dear: ratio 1) from dear drafts."""
        target, drafting = self.scale
        if drafting is None:
            return 1.0
        target = 1.0 if target is None else target
        low, high = CALIBRATION_BOUNDS
        return min(max(drafting / target, low), high)

    def choose(self, expected: list[float], batch_size: int, groups: Sequence[int] | None = None) -> int:
        """The next step's gamma (`AdaptiveGamma.choose`), called once per step right after the loop's
        sync: the time since the previous call is that step's, which moves `scale` (`calibrate`)."""
        policy, now = self.policy, time.perf_counter()
        if self._timing is not None:
            kind, predicted, started = self._timing
            measured = max(now - started, 1e-9) / predicted
            current = self.scale[kind]
            self.scale[kind] = measured if current is None else current + CALIBRATION_WEIGHT * (measured - current)
        # drafting steps' seconds scaled by r weigh as their expected tokens divided by r
        relative = self.relative()
        weighed = [tokens / (relative if g else 1.0) for g, tokens in enumerate(expected)]
        gamma = policy.choose(weighed, batch_size, groups)
        if gamma == 0 and policy.calibrate and self.scale[1] is None:  # drafting not yet timed
            gamma = policy.probe_gamma(weighed, batch_size, groups)
        self._target_run = 0 if gamma else self._target_run + 1
        if policy.calibrate:
            self._timing = (min(gamma, 1), policy.seconds(batch_size, groups)[gamma], now)
        return gamma

    def alpha(self) -> torch.Tensor:
        """Each row's acceptance estimate `[B]`."""
        weighed = self.weight * self.prior
        estimate = (self.accepted + weighed) / (self.accepted + self.rejections + self.weight)
        return estimate.clamp(0.0, _MAX_ALPHA)

    def update(self, num_accepted: torch.Tensor | None, gamma: int) -> None:
        """A step of `gamma` drafts in which each row accepted `num_accepted` `[B]` (gamma 0: a
        target-only step, `num_accepted` None)."""
        decay = self.policy.decay if gamma else self.policy.idle_decay
        self.accepted.mul_(decay)
        self.rejections.mul_(decay)
        self.weight.mul_(decay)
        if not gamma:
            self.weight.add_(self.policy.prior_weight * (1 - decay))
        if gamma and num_accepted is not None:
            self.accepted.add_(num_accepted)
            self.rejections.add_((num_accepted < gamma).float())

    def expected(self, room: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Expected tokens over the `active` rows `[B]` bool at each gamma 0..widest, `[G + 1]`
        fp32, each row's capped at its budget left `room` `[B]`."""
        alpha = self.alpha().unsqueeze(1)
        tokens = (1 - alpha ** (self.gammas + 1)) / (1 - alpha)
        tokens = torch.minimum(tokens, room.unsqueeze(1).float())
        return (tokens * active.unsqueeze(1)).sum(dim=0)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` `[B']` (finished rows leave the batch)."""
        self.prior = self.prior.index_select(0, rows)
        self.accepted = self.accepted.index_select(0, rows)
        self.rejections = self.rejections.index_select(0, rows)
        self.weight = self.weight.index_select(0, rows)
