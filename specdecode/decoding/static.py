"""The static-shape decode core: fixed buffers and pass widths, so the step functions can be compiled.

The eager loops (decode.py) read a KV window that grows with the longest row, build a float mask
each pass, drop finished rows from the batch and ask the host every step whether to stop. Every
one of those changes a tensor's shape or waits on the device, which is what keeps a compiled
(on CUDA: graph-captured) step from being replayed. Here, in the manner of gpt-fast while keeping
ragged batches:

* each KV cache is a fixed `[B, H_kv, S_cap, D]` buffer per layer (`StaticKVCache`), written at
  per-row positions with one indexed write and read whole; a boolean mask compares a fixed
  `arange(S_cap)` with each query's position, so slots past a row's length (other rows' padding,
  rejected drafts) are never seen;
* finished rows stay in the batch, masked: they commit nothing, count nothing, look nothing up,
  and their (ignored) passes keep every shape fixed;
* every pass has a fixed width: 1 for the target alone, gamma + 1 for a verify, the drafting
  strategies' own fixed windows (`specdecode.decoding.drafting`, unchanged: they run on this
  cache through `cached_forward` like on the ragged one);
* the host learns whether every row is done every few steps (`default_sync_every`), not every step;
* with `compile`, each speculative round (`_round`: draft, verify, accept, commit) runs under
  `torch.compile` as one graph, and so does each step of the target alone (CUDA graphs on CUDA;
  `compiled.py`), compiled once per shape (batch size, capacity, gamma, sampling mode), reused across
  calls: the capacity is the caller's `capacity`, else the need rounded up to a power of two. The
  prefills, whose widths the prompts set, run eagerly;
* a compiled call takes the buffers its steps write in place from a pool per model and shape
  (`static_buffers`), so later calls replay CUDA graphs at the addresses the first recorded.

What the caller gets is what the eager loops return: the same tokens in greedy decoding (in fp32
on these kernels; see `speculative_generate_static` for what exact means in bf16), the same
distribution when sampling (though not the same draws for a seed: masked rows still consume random
numbers), and the same counters.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specdecode.decoding.cache import cached_forward
from specdecode.decoding.compiled import (
    compiled_for,
    eager_passes,
    mark_static,
    mark_step,
    nested_layers,
    skipped_guards,
)
from specdecode.decoding.drafting import Drafting, drafting_for
from specdecode.decoding.lookup import PromptLookup
from specdecode.decoding.sampling import DrawnAhead, Params, SamplingParams, exponential_noise, next_tokens, uniform
from specdecode.decoding.static_buffers import static_buffers
from specdecode.decoding.static_cache import StaticKVCache, rows_capacity
from specdecode.decoding.static_rows import ActiveRowsLookup, DeviceCounters, Rows
from specdecode.decoding.stats import GenerationResult
from specdecode.decoding.verify import verify_drafts
from specdecode.models.feature_drafter import FeatureDrafter

# Steps between host syncs (is every row done?) on an accelerator: the host queues up to this many
# steps ahead and the batch may run up to this many - 1 steps past its last row's end. On the CPU
# the device is the host, a sync costs nothing, and every step is checked.
SYNC_EVERY_ACCELERATOR = 8
# Compiled steps (rounds) of a call that evaluate their guards; later ones skip them (`skipped_guards`).
GUARDED_STEPS = 2


def default_sync_every(device: torch.device) -> int:
    return 1 if device.type == "cpu" else SYNC_EVERY_ACCELERATOR


def _prefill(
    model: torch.nn.Module, cache: StaticKVCache, rows: Rows, feature_layers: tuple[int, ...] | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cache the right-padded prompts; the logits at each row's last prompt token `[B, V]` and,
    with `feature_layers`, the features of all prompt positions `[B, T, n·H]`."""
    longest = max(rows.prompt_lengths)
    last = rows.lengths - 1
    positions = torch.unique(last)
    out = cached_forward(
        model, cache, rows.tokens[:, :longest], logits_to_keep=positions, feature_layers=feature_layers
    )
    logits, hidden = out if feature_layers is not None else (out, None)
    cache.set_lengths(rows.lengths.clone())
    column = torch.searchsorted(positions, last)
    return logits[torch.arange(len(last), device=last.device), column], hidden


def _draws_ahead(
    generator: torch.Generator,
    batch_size: int,
    gamma: int,
    draw_width: int | None,
    vocab_size: int,
    device: torch.device,
) -> DrawnAhead:
    """A sampled round's draws from `generator`, as the round would draw them: one Exp(1) race per
    draft over the drafter's `draw_width` ids (None: the target's `vocab_size`), the uniforms of the
    acceptance test, and the race of the resample over the target's vocabulary (`sample`,
    `rejection_sample`)."""
    races = [exponential_noise((batch_size, draw_width or vocab_size), device, generator) for _ in range(gamma)]
    acceptance = uniform((batch_size, gamma), device, generator)
    return DrawnAhead([*races, acceptance, exponential_noise((batch_size, vocab_size), device, generator)])


def _max_steps(budgets: list[int]) -> int:
    """Steps after the prefill that finish every row: each commits at least one token per active row."""
    return max(max(budgets) - 1, 0)


def _round(
    target: PreTrainedModel,
    drafting: Drafting,
    rows: Rows,
    cache: StaticKVCache,
    counters: DeviceCounters,
    lookup: ActiveRowsLookup | None,
    params: Params,
    gamma: int,
    generator: torch.Generator | DrawnAhead | None,
) -> None:
    """One round of the static core: draft gamma tokens per row, verify them in one target pass,
    accept or resample, commit. No host sync, and a seeded generator's draws made ahead
    (`DrawnAhead`), so under `compile` it traces as one graph."""
    if lookup is not None:
        lookup.active = rows.active
    cache.set_lengths(rows.lengths - 1)
    # 1. draft gamma tokens. A row of a one-token prompt and no budget holds one token where a
    # drafter may re-read two: its (masked) drafts then read a padding token.
    draft, q = drafting.propose(rows.tokens, rows.lengths.clamp_min(2), rows.capacity, gamma, params, generator)
    # 2. verify the pending token and the gamma drafts in one target pass; accept / resample
    num_accepted, _, new_tokens = verify_drafts(
        target, cache, drafting, rows.last(1), draft, q, rows.lengths - 1, params, generator
    )
    counters.record_step(num_accepted, rows.active)
    rows.commit(new_tokens, num_accepted + 1)


def speculative_generate_static(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    prompts: Sequence[Sequence[int]],
    budgets: list[int],
    eos: list[int],
    params: SamplingParams,
    gamma: int,
    generator: torch.Generator | None,
    lookup: PromptLookup | None,
    compile: bool,
    capacity: int | None = None,
) -> GenerationResult:
    """`speculative_generate(static=True)` on checked arguments (see the module docstring).

    Exact, in greedy decoding, means each token is the argmax of the target's logits at that
    position as the target computes them in a pass of this batch's shape. In fp32 that is
    target-alone greedy. In bf16 passes of other widths, read windows or kernels (eager or
    compiled: inductor fuses and rounds otherwise) round differently, so where the target's top
    two logits lie within bf16 rounding of each other they can pick different tokens: bf16 greedy
    is exact against target-alone greedy in bf16 on the same batch shape and core, up to such
    near-ties, and the rate is measured (`specdecode.evaluation.core_benchmark`), not assumed.
    """
    start = time.perf_counter()
    device = target.device
    batch_size, capacity = len(prompts), rows_capacity(prompts, budgets, gamma, capacity)
    with static_buffers(compile, (batch_size, capacity)) as lease:
        # what a round writes in place, at the addresses earlier calls of this shape used (compiled)
        zeros, drafter_zeros = lease.zeros_for(target), lease.zeros_for(drafter)
        rows = Rows.from_prompts(prompts, budgets, gamma, eos=eos, device=device, capacity=capacity, zeros=zeros)
        target_cache = StaticKVCache.for_model(target, batch_size, capacity, zeros)
        row_lookup = ActiveRowsLookup(lookup) if lookup is not None else None
        drafting = drafting_for(drafter, batch_size, capacity, row_lookup, drafter_zeros)  # type: ignore[arg-type]
        # the drafting strategy drives its drafter on a cache of the same fixed shape
        drafting.cache = StaticKVCache.for_model(drafter, batch_size, capacity, drafter_zeros)
        counters = DeviceCounters(gamma, device, zeros)
        sync_every = default_sync_every(device)
        run_round, round_params = compiled_for(_round, params, device, compile)
        seeded = generator is not None and not params.greedy

        # 0. prefill: the target's first token is an ordinary sample; the drafter only reads the prompt.
        first, hidden = _prefill(target, target_cache, rows, drafting.feature_layers)
        with eager_passes(compile):
            drafting.prefill(rows.tokens, rows.lengths, max(rows.prompt_lengths), hidden)
        counters.record_target_call(torch.ones_like(rows.active))
        rows.commit(next_tokens(first, params, generator).unsqueeze(1), torch.ones_like(rows.lengths))
        if compile:
            mark_static(rows.tokens, counters.calls, counters.histogram, *drafting.state())
        vocab_size = first.shape[-1]

        with nested_layers(*([target, drafter] if compile else [])):
            for step in range(_max_steps(budgets)):
                if step % sync_every == 0 and not rows.active.any().item():
                    break
                mark_step(compile, device)
                # a seeded generator's draws are made ahead, in the order the round uses them
                draws = (
                    _draws_ahead(generator, batch_size, gamma, drafting.draw_width, vocab_size, device)
                    if seeded
                    else generator
                )
                with skipped_guards(compile and step >= GUARDED_STEPS):
                    run_round(target, drafting, rows, target_cache, counters, row_lookup, round_params, gamma, draws)
                if isinstance(draws, DrawnAhead) and draws.used != len(draws.draws):
                    raise RuntimeError(f"a round used {draws.used} of the {len(draws.draws)} draws made for it")
                if compile:
                    # the round's reassigned state out of its CUDA graph's memory, before the next replay
                    rows.lengths, rows.active = rows.lengths.clone(), rows.active.clone()
                    target_cache.lengths = target_cache.lengths.clone()
                    drafting.copy_out()

        # read before the buffers go back to the pool
        stats = counters.finish(gamma, 1, drafting.looked_up)
        return GenerationResult.build(rows.sequences(), stats, time.perf_counter() - start)  # type: ignore[arg-type]


def _step(
    target: PreTrainedModel,
    rows: Rows,
    cache: StaticKVCache,
    counters: DeviceCounters,
    written: torch.Tensor | None,
    params: Params,
    generator: DrawnAhead | None,
    feature_layers: tuple[int, ...] | None,
) -> None:
    """One step of the target alone: a one-token pass of the whole batch, sample (against a seeded
    generator's draws made ahead, where given), commit, and with `feature_layers` write each active
    row's features into `written` `[B, S_cap, n·H]`. No host sync and no generator, so under
    `compile` it traces as one graph."""
    cache.set_lengths(rows.lengths - 1)
    active = rows.active
    out = cached_forward(target, cache, rows.last(1), feature_layers=feature_layers)
    logits, hidden = out if feature_layers is not None else (out, None)
    if written is not None:
        # a masked row writes to the last slot, past every row's output
        batch_index = torch.arange(written.shape[0], device=written.device)
        written[batch_index, torch.where(active, rows.lengths - 1, rows.capacity - 1)] = hidden[:, -1]
    counters.record_target_call(active)
    rows.commit(next_tokens(logits[:, -1], params, generator).unsqueeze(1), torch.ones_like(rows.lengths))


def autoregressive_generate_static(
    target: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    budgets: list[int],
    eos: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    feature_layers: tuple[int, ...] | None,
    compile: bool,
    capacity: int | None = None,
) -> GenerationResult:
    """`autoregressive_generate(static=True)` on checked arguments: one-token passes of the whole
    batch, finished rows masked; with `feature_layers`, `result.features` as the eager loop's.
    With `compile`, each step is one graph, as a speculative round is; a seeded generator's draws
    are drawn before each step and passed in (`DrawnAhead`), the numbers `sample` would draw."""
    start = time.perf_counter()
    device = target.device
    batch_size, capacity = len(prompts), rows_capacity(prompts, budgets, None, capacity)
    with static_buffers(compile, (batch_size, capacity)) as lease:
        # what a step writes in place, at the addresses earlier calls of this shape used (compiled)
        zeros = lease.zeros_for(target)
        rows = Rows.from_prompts(prompts, budgets, None, eos=eos, device=device, capacity=capacity, zeros=zeros)
        cache = StaticKVCache.for_model(target, batch_size, capacity, zeros)
        counters = DeviceCounters(0, device, zeros)
        sync_every = default_sync_every(device)
        run_step, step_params = compiled_for(_step, params, device, compile)
        seeded = generator is not None and not params.greedy

        logits, hidden = _prefill(target, cache, rows, feature_layers)
        noise_shape = tuple(logits.shape)  # [B, V]: one draw per row and token id
        written = None
        if hidden is not None:
            written = zeros("features.written", (batch_size, capacity, hidden.shape[-1]), hidden.dtype, hidden.device)
            written[:, : hidden.shape[1]] = hidden
        counters.record_target_call(torch.ones_like(rows.active))
        rows.commit(next_tokens(logits, params, generator).unsqueeze(1), torch.ones_like(rows.lengths))
        if compile:
            mark_static(rows.tokens, counters.calls, counters.histogram, *([written] if written is not None else []))
        with nested_layers(*([target] if compile else [])):
            for step in range(_max_steps(budgets)):
                if step % sync_every == 0 and not rows.active.any().item():
                    break
                mark_step(compile, device)
                # a seeded generator's draws are made ahead, as for a round
                draws = DrawnAhead([exponential_noise(noise_shape, device, generator)]) if seeded else None
                with skipped_guards(compile and step >= GUARDED_STEPS):
                    run_step(target, rows, cache, counters, written, step_params, draws, feature_layers)
                if compile:
                    # the step's reassigned state out of its CUDA graph's memory, before the next replay
                    rows.lengths, rows.active = rows.lengths.clone(), rows.active.clone()
                    cache.lengths = cache.lengths.clone()

        sequences = rows.sequences()
        result = GenerationResult.build(sequences, counters.finish(0, 0, 0), time.perf_counter() - start)  # type: ignore[arg-type]
        if written is not None:
            result.features = []
            for i, (length, generated) in enumerate(zip(rows.prompt_lengths, sequences)):
                row = written[i, : length + len(generated)].clone()
                if generated:
                    row[-1] = 0  # the last generated token is never fed, as in the eager loop
                result.features.append(row)
        return result
