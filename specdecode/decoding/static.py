"""The static and compiled decoders: fixed buffers and pass widths, so the steps can be compiled.

As in gpt-fast but with ragged batches: each layer's KV cache `[B, H_kv, S_cap, D]` is read whole
under a boolean mask; finished rows stay, masked. `CompiledDecoder` runs each round (`_round`) or
target step (`_step`) as one graph per shape, its buffers pooled (`static_buffers`) so later calls
replay. Both match the eager decoder's greedy tokens (fp32) and distribution (not a seed's draws once
a row finishes: masked rows still draw).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import PreTrainedModel

from specdecode.decoding.cache import cached_forward_features
from specdecode.decoding.compiled import (
    compiled_for,
    eager_passes,
    mark_step,
    nested_layers,
    outputs_copied,
    skipped_guards,
)
from specdecode.decoding.decoder import Decoder, Request
from specdecode.decoding.drafting import Drafting, drafting_for
from specdecode.decoding.lookup import ActiveRowsLookup
from specdecode.decoding.mixed import RowDrafters
from specdecode.decoding.rows import FeatureRows, StaticRows, prefill
from specdecode.decoding.sampling import DrawnAhead, Params, SamplingParams, next_tokens, sample_draws, uniform
from specdecode.decoding.static_buffers import Lease, static_buffers
from specdecode.decoding.static_cache import StaticKVCache, rows_capacity
from specdecode.decoding.stats import DeviceCounters, GenerationResult
from specdecode.decoding.verify import verify_drafts
from specdecode.models.feature_drafter import FeatureDrafter

# Steps between host syncs (is every row done?) on an accelerator, which may run this many - 1 steps
# past the last row's end; on the CPU a sync costs nothing and every step is checked.
SYNC_EVERY_ACCELERATOR = 8
# Compiled steps (rounds) of a call that evaluate their guards; later ones skip them (`skipped_guards`).
GUARDED_STEPS = 2


def default_sync_every(device: torch.device) -> int:
    return 1 if device.type == "cpu" else SYNC_EVERY_ACCELERATOR


def _draws_ahead(
    generator: torch.Generator,
    batch_size: int,
    gamma: int,
    draw_width: int | None,
    vocab_size: int,
    device: torch.device,
) -> DrawnAhead:
    """A sampled round's draws, in its order: each draft's, the acceptance uniforms, the resample's."""
    drafts = [sample_draws((batch_size, draw_width or vocab_size), device, generator) for _ in range(gamma)]
    acceptance = uniform((batch_size, gamma), device, generator)
    return DrawnAhead([*drafts, acceptance, sample_draws((batch_size, vocab_size), device, generator)])


def _round(
    target: PreTrainedModel,
    drafting: Drafting,
    rows: StaticRows,
    cache: StaticKVCache,
    counters: DeviceCounters,
    lookup: ActiveRowsLookup | None,
    params: Params,
    gamma: int,
    generator: torch.Generator | DrawnAhead | None,
) -> None:
    """One round: draft gamma tokens per row, verify them in one target pass, accept or resample,
    commit. No host sync and a seeded generator's draws made ahead, so it traces as one graph."""
    if lookup is not None:
        lookup.active = rows.active
    cache.set_lengths(rows.lengths - 1)
    # 1. draft gamma tokens (a masked one-token row's drafts read a padding token)
    draft, q = drafting.propose(rows.tokens, rows.lengths.clamp_min(2), rows.capacity, gamma, params, generator)
    # 2. verify the pending token and the gamma drafts in one target pass; accept / resample
    num_accepted, _, new_tokens = verify_drafts(
        target, cache, drafting, rows.last(1), draft, q, rows.lengths - 1, params, generator
    )
    counters.record_step(num_accepted, rows.active)
    rows.commit(new_tokens, num_accepted + 1)


def _step(
    target: PreTrainedModel,
    rows: StaticRows,
    cache: StaticKVCache,
    counters: DeviceCounters,
    written: torch.Tensor | None,
    params: Params,
    generator: DrawnAhead | None,
    feature_layers: tuple[int, ...] | None,
) -> None:
    """One step of the target alone over the whole batch, committed; with `feature_layers`, each
    active row's features written into `written` `[B, S_cap, n·H]`. No host sync, so one graph."""
    cache.set_lengths(rows.lengths - 1)
    active = rows.active
    logits, hidden = cached_forward_features(target, cache, rows.last(1), feature_layers=feature_layers)
    if written is not None and hidden is not None:
        # a masked row writes to the last slot, past every row's output
        batch_index = torch.arange(written.shape[0], device=written.device)
        written[batch_index, torch.where(active, rows.lengths - 1, rows.capacity - 1)] = hidden[:, -1]
    counters.record_target_call(active)
    rows.commit(next_tokens(logits[:, -1], params, generator).unsqueeze(1), torch.ones_like(rows.lengths))


@dataclass(frozen=True)
class StaticDecoder(Decoder):
    """The static-shape loops, uncompiled; `capacity`: cache slots per row (None: a power of two)."""

    capacity: int | None = None
    # whether the steps run compiled (`CompiledDecoder`)
    compile: ClassVar[bool] = False

    def check_room(self, request: Request) -> None:
        if self.capacity is not None:
            rows_capacity(request.prompts, request.budgets, request.gamma, self.capacity)

    def _compiled(
        self, function: Callable[..., None], params: SamplingParams, device: torch.device
    ) -> tuple[Callable[..., None], Params]:
        """A step `function` and the sampling params to call it with, as this decoder runs them."""
        return compiled_for(function, params, device) if self.compile else (function, params)

    @contextlib.contextmanager
    def _step(self, step: int, device: torch.device, *state: object) -> Iterator[None]:
        """The block step `step` runs in, changing the attributes of `state`."""
        if not self.compile:
            yield
            return
        mark_step(True, device)
        with skipped_guards(step >= GUARDED_STEPS), outputs_copied(*state):
            yield

    @contextlib.contextmanager
    def _buffers(
        self, target: PreTrainedModel, request: Request, gamma: int | None
    ) -> Iterator[tuple[Lease, StaticRows, StaticKVCache, DeviceCounters]]:
        """A call's pooled buffers (`static_buffers`), rows, target cache and counters; `gamma` None: target steps."""
        capacity = rows_capacity(request.prompts, request.budgets, gamma, self.capacity)
        batch_size, device = len(request.prompts), target.device
        with static_buffers(self.compile, (batch_size, capacity)) as lease:
            zeros = lease.zeros_for(target)
            rows = StaticRows(request.prompts, request.budgets, capacity, request.eos, device, zeros)
            cache = StaticKVCache.for_model(target, batch_size, capacity, zeros)
            yield lease, rows, cache, DeviceCounters(gamma or 0, device, zeros)

    def _run(
        self, rows: StaticRows, budgets: list[int], models: Sequence[torch.nn.Module], run: Callable[[int], object]
    ) -> None:
        """`run(step)` until every row is done, asked every `default_sync_every` steps."""
        sync_every = default_sync_every(rows.tokens.device)
        with nested_layers(*models) if self.compile else contextlib.nullcontext():
            for step in range(max(max(budgets) - 1, 0)):
                if step % sync_every == 0 and not rows.active.any().item():
                    break
                run(step)

    def speculative(
        self, target: PreTrainedModel, drafter: PreTrainedModel | FeatureDrafter | RowDrafters, request: Request
    ) -> GenerationResult:
        """In fp32 greedy is target-alone greedy; in bf16, passes of other widths round differently,
        so near-tied top logits can pick other tokens (the benchmark measures that rate)."""
        assert not isinstance(drafter, RowDrafters), "speculative_generate sends a mixed batch to the eager decoder"
        start = time.perf_counter()
        device, params, generator, batch_size = target.device, request.params, request.generator, len(request.prompts)
        gamma, lookup = request.gamma or 0, request.lookup
        with self._buffers(target, request, gamma) as (lease, rows, target_cache, counters):
            row_lookup = ActiveRowsLookup(lookup) if lookup is not None else None
            drafter_cache = StaticKVCache.for_model(drafter, batch_size, rows.capacity, lease.zeros_for(drafter))
            drafting = drafting_for(drafter, drafter_cache, row_lookup, gamma)
            run_round, round_params = self._compiled(_round, params, device)
            # the generator whose draws each round makes ahead: None when greedy or unseeded
            seeded = generator if not params.greedy else None

            # 0. prefill: the target's first token is an ordinary sample; the drafter only reads the prompt.
            first, hidden = prefill(target, target_cache, rows, drafting.feature_layers)
            with eager_passes(self.compile):
                drafting.prefill(rows.tokens, rows.lengths, max(rows.prompt_lengths), hidden)
            counters.record_target_call(torch.ones_like(rows.active))
            rows.commit(next_tokens(first, params, generator).unsqueeze(1), torch.ones_like(rows.lengths))
            vocab_size = first.shape[-1]
            state = [obj for obj in (rows, target_cache, drafting, drafter_cache, row_lookup) if obj is not None]

            def run(step: int) -> None:
                # a seeded generator's draws are made ahead, in the order the round uses them
                draws = (
                    _draws_ahead(seeded, batch_size, gamma, drafting.draw_width, vocab_size, device)
                    if seeded is not None
                    else generator
                )
                with self._step(step, device, *state):
                    run_round(target, drafting, rows, target_cache, counters, row_lookup, round_params, gamma, draws)
                if isinstance(draws, DrawnAhead) and draws.used != len(draws.draws):
                    raise RuntimeError(f"a round used {draws.used} of the {len(draws.draws)} draws made for it")

            self._run(rows, request.budgets, (target, drafter), run)
            # read before the buffers go back to the pool
            stats = counters.finish(drafting.looked_up)
            return GenerationResult.build(rows.sequences(), stats, time.perf_counter() - start)

    def autoregressive(self, target: PreTrainedModel, request: Request) -> GenerationResult:
        """One-token passes of the whole batch, finished rows masked; seeded draws made ahead."""
        start = time.perf_counter()
        device, params, generator = target.device, request.params, request.generator
        feature_layers = request.feature_layers
        with self._buffers(target, request, None) as (lease, rows, cache, counters):
            run_step, step_params = self._compiled(_step, params, device)
            seeded = generator is not None and not params.greedy

            logits, hidden = prefill(target, cache, rows, feature_layers)
            noise_shape = tuple(logits.shape)  # [B, V]: one draw per row and token id
            features = FeatureRows(hidden, rows.capacity, lease.zeros_for(target)) if hidden is not None else None
            written = features.values if features is not None else None
            counters.record_target_call(torch.ones_like(rows.active))
            rows.commit(next_tokens(logits, params, generator).unsqueeze(1), torch.ones_like(rows.lengths))

            def run(step: int) -> None:
                # a seeded generator's draws are made ahead, as for a round
                draws = DrawnAhead([sample_draws(noise_shape, device, generator)]) if seeded else None
                with self._step(step, device, rows, cache):
                    run_step(target, rows, cache, counters, written, step_params, draws, feature_layers)

            self._run(rows, request.budgets, (target,), run)
            sequences = rows.sequences()
            result = GenerationResult.build(sequences, counters.finish(), time.perf_counter() - start)
            if features is not None:
                result.features = features.rows(rows.prompt_lengths, sequences)
            return result


@dataclass(frozen=True)
class CompiledDecoder(StaticDecoder):
    """The static loops with each round (step) one compiled graph, guards skipped after the first."""

    compile: ClassVar[bool] = True
