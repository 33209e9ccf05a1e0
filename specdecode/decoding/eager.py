"""The eager decoder: ragged caches whose read window grows with the longest row, and finished rows
leaving the batch (`RaggedRows`, `Finisher`), so later passes are narrower; the host checks every step.

Invariant between steps, per row: `tokens[:length]` are committed (prompt + generated); the target
cache holds all but the last committed token (the "pending" one, fed in the next pass). The loop is
the same for every drafter kind (`drafting.Drafting`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from specdecode.decoding.adaptive import GammaState
from specdecode.decoding.cache import KVCache, RaggedKVCache, cached_forward_features
from specdecode.decoding.decoder import Decoder, Request
from specdecode.decoding.drafting import CATCH_UP
from specdecode.decoding.mixed import RowDrafters, ragged_drafting
from specdecode.decoding.record import Recorder, StepEvent
from specdecode.decoding.rows import FeatureRows, RaggedRows, prefill
from specdecode.decoding.sampling import next_tokens, row_tokens
from specdecode.decoding.stats import DeviceCounters, GenerationResult, StepCounters
from specdecode.decoding.verify import verify_drafts
from specdecode.models.feature_drafter import FeatureDrafter


class RowsKept(Protocol):
    """What keeps per-row state beside the batch (caches, drafting, the adaptive gamma's counts)."""

    def select_rows(self, rows: torch.Tensor) -> None: ...


class Finisher:
    """Collects finished rows' outputs and drops them from the batch and the caches."""

    def __init__(self, num_rows: int, recorder: Recorder | None = None) -> None:
        self.sequences: list[list[int] | None] = [None] * num_rows
        self.recorder = recorder
        # what the last `step` brought to the host beside its own figures (`also`)
        self.also: list[float] = []

    def step(
        self,
        batch: RaggedRows,
        finished: torch.Tensor,
        caches: Sequence[RowsKept],
        also: torch.Tensor | None = None,
    ) -> int | None:
        """Between steps: retire finished rows; return the longest row's length, None once all are done.
        The one host sync of a step, which also brings `also` (1-D float, kept in `self.also`)."""
        figures = torch.stack([finished.any().float(), batch.lengths.max().float()])
        synced = (figures if also is None else torch.cat([figures, also.float()])).tolist()
        any_finished, max_length, self.also = bool(synced[0]), int(synced[1]), synced[2:]
        if self.recorder is not None:
            self.recorder.synced()
        if any_finished:
            self._collect(batch, finished, caches)
            if batch.rows.numel() == 0:
                return None
        return max_length

    def _collect(self, batch: RaggedRows, finished: torch.Tensor, caches: Sequence[RowsKept]) -> None:
        done = finished.nonzero().squeeze(1)
        for b, row, length in zip(done.tolist(), batch.rows[done].tolist(), batch.lengths[done].tolist()):
            start = batch.prompt_lengths[row]
            self.sequences[row] = batch.tokens[b, start:length].tolist()
        keep = (~finished).nonzero().squeeze(1)
        batch.keep(keep)
        for cache in caches:
            cache.select_rows(keep)


@dataclass(frozen=True)
class EagerDecoder(Decoder):
    """`record`: keep each step's drafts and outcome per row (`result.record`); `on_step`: called
    after every step with the tokens each row committed (one more host sync per step)."""

    record: bool = False
    on_step: Callable[[StepEvent], None] | None = None

    def _recorder(self, rows: RaggedRows, start: float) -> Recorder | None:
        return Recorder(rows.prompt_lengths, start, self.on_step) if self.record or self.on_step is not None else None

    def _result(self, finisher: Finisher, counters: StepCounters, start: float) -> GenerationResult:
        """The result of the sequences `finisher` collected (`counters` read: one host sync)."""
        result = GenerationResult.build(finisher.sequences, counters, time.perf_counter() - start)
        result.record = finisher.recorder.rows() if self.record and finisher.recorder is not None else None
        return result

    def speculative(
        self, target: PreTrainedModel, drafter: PreTrainedModel | FeatureDrafter | RowDrafters, request: Request
    ) -> GenerationResult:
        start = time.perf_counter()
        params, generator, batch_size = request.params, request.generator, len(request.prompts)
        gamma = request.gamma or 0  # the widest step's, where `request.adaptive` chooses each step's
        # room past the longest row for a verify of gamma + 1, and for a feature drafter's catch-up
        # window after target-only steps (`drafting.CATCH_UP`)
        slack = gamma + 2 + (CATCH_UP + 1 if request.adaptive is not None else 0)
        rows = RaggedRows(request.prompts, request.budgets, slack=slack, eos=request.eos, device=target.device)
        target_cache = RaggedKVCache.for_model(target, batch_size, rows.capacity)
        drafting = ragged_drafting(target, drafter, batch_size, rows.capacity, request.lookup, gamma)
        adaptive = None
        if request.adaptive is not None:
            priors = None if request.priors is None else torch.tensor(request.priors)
            adaptive = request.adaptive.start(batch_size, target.device, priors)
        counters = DeviceCounters(gamma, target.device)
        recorder = self._recorder(rows, start)
        finisher = Finisher(batch_size, recorder)
        kept: list[RowsKept] = [target_cache, drafting]
        if adaptive is not None:
            kept.append(adaptive)

        # 0. prefill: the target's first token is an ordinary sample; the drafter only reads the prompt.
        first, hidden = prefill(target, target_cache, rows, feature_layers=drafting.feature_layers)
        drafting.prefill(rows.tokens, rows.lengths, max(rows.prompt_lengths), hidden)
        finished = _commit_token(rows, next_tokens(first, params, generator), counters, recorder)

        while (max_length := finisher.step(rows, finished, kept, _expected(adaptive, rows, finished))) is not None:
            target_cache.set_lengths(rows.lengths - 1, max_length - 1)
            if adaptive is not None:
                step_gamma = adaptive.choose(finisher.also, rows.rows.numel(), drafting.groups)
                counters.gamma_steps[step_gamma] = counters.gamma_steps.get(step_gamma, 0) + 1
            else:
                step_gamma = gamma
            if step_gamma == 0:
                # a plain target step: no drafts pay at this batch and acceptance
                layers = drafting.feature_layers
                finished = _target_step(
                    target, target_cache, rows, counters, recorder, request, layers, drafting.observe
                )
                drafting.skip(rows.tokens, rows.lengths, max_length + 1)  # the drafter falls one step behind
                if adaptive is not None:
                    adaptive.update(None, 0)
                    if adaptive.leaves():  # no draft has paid for a while: the target alone to the end
                        _target_steps(target, target_cache, rows, finished, finisher, counters, request)
                        break
                continue

            # 1. draft gamma tokens, keeping q exactly as sampled from (None when greedy: not needed)
            draft, q = drafting.propose(rows.tokens, rows.lengths, max_length, step_gamma, params, generator)

            # 2. verify in one target pass: the pending token and the gamma drafts; 3. accept / resample
            num_accepted, next_token, new_tokens = verify_drafts(
                target, target_cache, drafting, rows.last(1), draft, q, rows.lengths - 1, params, generator
            )
            finished = rows.commit(new_tokens, num_accepted + 1)
            every = torch.ones_like(num_accepted, dtype=torch.bool)
            counters.record_step(num_accepted, every, step_gamma, drafting.drafting_rows)
            if adaptive is not None:
                adaptive.update(num_accepted, step_gamma)
            if recorder is not None:
                recorder.add(rows.rows, rows.lengths, next_token, draft, num_accepted, drafting.last_looked_up)

            # 4. trim caches: done at the top of the loop from the committed lengths (rejected drafts'
            # entries stay in their slots, masked, until overwritten).

        result = self._result(finisher, counters.finish(drafting.looked_up), start)
        if adaptive is not None:  # the steps after leaving the loop are target steps too
            steps = result.stats.gamma_steps
            after = result.stats.target_calls - 1 - sum(steps.values())
            if after:
                steps[0] = steps.get(0, 0) + after
        return result

    def autoregressive(self, target: PreTrainedModel, request: Request) -> GenerationResult:
        start = time.perf_counter()
        feature_layers, batch_size = request.feature_layers, len(request.prompts)
        rows = RaggedRows(request.prompts, request.budgets, slack=1, eos=request.eos, device=target.device)
        cache = RaggedKVCache.for_model(target, batch_size, rows.capacity)
        counters = DeviceCounters(0, target.device)

        logits, hidden = prefill(target, cache, rows, feature_layers=feature_layers)
        temperatures = None
        if request.temperatures is not None:  # each prompt's continuations share its prefill
            index = rows.fan_out(len(request.temperatures))
            cache.select_rows(index)
            logits, hidden = logits.index_select(0, index), None if hidden is None else hidden.index_select(0, index)
            temperatures = torch.tensor(request.temperatures * batch_size, device=target.device)
        recorder = self._recorder(rows, start)
        finisher = Finisher(rows.rows.numel(), recorder)
        features = FeatureRows(hidden, rows.capacity) if hidden is not None else None
        finished = _commit_token(rows, _draw(logits, rows, request, temperatures), counters, recorder)
        _target_steps(target, cache, rows, finished, finisher, counters, request, features, temperatures)

        result = self._result(finisher, counters.finish(), start)
        if features is not None:
            result.features = features.rows(rows.prompt_lengths, result.sequences)
        return result


def _target_steps(
    target: PreTrainedModel,
    cache: KVCache,
    rows: RaggedRows,
    finished: torch.Tensor,
    finisher: Finisher,
    counters: DeviceCounters,
    request: Request,
    features: FeatureRows | None = None,
    temperatures: torch.Tensor | None = None,
) -> None:
    """The target alone decodes `rows` to their ends (`finished` `[B]`: after the last commit),
    keeping each token's features in `features` where given (`temperatures`: as `_draw`)."""
    layers, observe = None, None
    if features is not None:
        layers, observe = request.feature_layers, lambda hidden, at: features.write(rows.rows, at, hidden[:, -1])
    while (max_length := finisher.step(rows, finished, (cache,))) is not None:
        cache.set_lengths(rows.lengths - 1, max_length - 1)
        finished = _target_step(
            target, cache, rows, counters, finisher.recorder, request, layers, observe, temperatures
        )


def _target_step(
    target: PreTrainedModel,
    cache: KVCache,
    rows: RaggedRows,
    counters: DeviceCounters,
    recorder: Recorder | None,
    request: Request,
    layers: tuple[int, ...] | None = None,
    observe: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    temperatures: torch.Tensor | None = None,
) -> torch.Tensor:
    """One pass of the target alone, its token committed to every row → finished `[B]`; `observe`
    gets the pass's features of `layers` `[B, 1, n·H]` and their positions `[B]`."""
    logits, hidden = cached_forward_features(target, cache, rows.last(1), feature_layers=layers)
    if observe is not None and hidden is not None:
        observe(hidden, rows.lengths - 1)
    return _commit_token(rows, _draw(logits[:, -1], rows, request, temperatures), counters, recorder)


def _draw(logits: torch.Tensor, rows: RaggedRows, request: Request, temperatures: torch.Tensor | None) -> torch.Tensor:
    """The target's token of each row from its `logits` `[B, V]`, drawn as `request.params` says, or
    with `temperatures` (`[rows]`, by row number: `rows.rows`) each row at its own."""
    if temperatures is None:
        return next_tokens(logits, request.params, request.generator)
    return row_tokens(logits, temperatures.index_select(0, rows.rows), request.params, request.generator)


def _commit_token(
    rows: RaggedRows, token: torch.Tensor, counters: DeviceCounters, recorder: Recorder | None
) -> torch.Tensor:
    """Commit the target's token `[B]` to each row, counting its pass and recording it: `finished` `[B]` bool."""
    finished = rows.commit(token.unsqueeze(1), torch.ones_like(rows.lengths))
    counters.record_target_call(torch.ones_like(finished))
    if recorder is not None:
        recorder.add(rows.rows, rows.lengths, token)
    return finished


def _expected(adaptive: GammaState | None, rows: RaggedRows, finished: torch.Tensor) -> torch.Tensor | None:
    """The tokens the rows still decoding expect at each gamma (`GammaState.expected`); None without adaptive gamma."""
    return None if adaptive is None else adaptive.expected(rows.limits - rows.lengths, ~finished)
