"""The shared decode loops: speculative (drafter + target) and autoregressive (target alone).

Both run on the same machinery (ragged KV caches, one commit rule for EOS and budgets, finished rows
leaving the batch: `ragged.py`; the same attention: `attention.py`), so a speedup measured between
them compares like with like. `static=True` runs either on the static-shape core (`static.py`).

Invariant between steps, per row: `tokens[:length]` are committed (prompt + generated); the target
cache holds all but the last committed token (the "pending" one, fed in the next pass). How a
drafter keeps its own state (a slice drafter's cache, a feature drafter's cache and the target
features it reads) is in decoding/drafting.py (the `Drafting` protocol); the loop is the same for both kinds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from specdecode.decoding.attention import folded_gqa
from specdecode.decoding.cache import RaggedKVCache, cached_forward
from specdecode.decoding.compiled import check_core
from specdecode.decoding.drafting import Drafting, drafting_for
from specdecode.decoding.lookup import DEFAULT_LOOKUP, PromptLookup
from specdecode.decoding.ragged import Batch, FeatureRows, Finisher, prefill
from specdecode.decoding.record import Recorder, StepEvent, check_record
from specdecode.decoding.sampling import SamplingParams, next_tokens
from specdecode.decoding.static import autoregressive_generate_static, speculative_generate_static
from specdecode.decoding.static_cache import rows_capacity
from specdecode.decoding.stats import GenerationResult, StepCounters
from specdecode.decoding.validation import check_feature_layers, check_seed, validate_models, validate_request
from specdecode.decoding.verify import verify_drafts
from specdecode.models.feature_drafter import FeatureDrafter

DEFAULT_GAMMA = 4


def drafter_gamma(drafter: PreTrainedModel | FeatureDrafter) -> int:
    """The gamma stored with a trained drafter (`config.specdecode_gamma`), else `DEFAULT_GAMMA`."""
    gamma = getattr(drafter.config, "specdecode_gamma", None)
    return gamma if isinstance(gamma, int) and not isinstance(gamma, bool) and gamma >= 1 else DEFAULT_GAMMA


def _generator(seed: object, device: torch.device) -> torch.Generator | None:
    """A generator seeded with `seed` (checked: `check_seed`), or None for torch's global one."""
    seed = check_seed(seed)
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


@torch.inference_mode()
def speculative_generate(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    gamma: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_ids: Sequence[int] | int | None = None,
    seed: int | None = None,
    prompt_lookup: PromptLookup | None = DEFAULT_LOOKUP,
    static: bool = False,
    compile: bool | None = None,
    capacity: int | None = None,
    record: bool = False,
    on_step: Callable[[StepEvent], None] | None = None,
) -> GenerationResult:
    """Generate from `target` with `drafter` proposing `gamma` tokens per target pass.

    `gamma=None` uses the drafter's own (`config.specdecode_gamma`, the candidate its training
    timed fastest on held-out prompts, the shortest within noise: `choose_gamma`), else `DEFAULT_GAMMA`.

    The output distribution is exactly the target's (greedy: token-identical to target-only greedy).
    `drafter` is a causal LM sharing the target's vocabulary or a `FeatureDrafter` (it then reads
    the target's hidden states, which the verify pass computes anyway). `prompts` is a ragged batch
    of token-id lists (no padding); `max_new_tokens` is one budget or one per prompt; generation
    stops per row at any of `eos_token_ids` (included in the output). `prompt_lookup`: where the
    drafter is unsure, copy what followed an earlier occurrence of the row's last tokens (exact;
    `specdecode.decoding.lookup`); None: the drafter alone. `static=True` runs the static-shape
    core (`specdecode.decoding.static`: fixed caches and pass widths, finished rows masked), and
    `compile` compiles its steps there (None: on for CUDA, `compiled.COMPILE_ON_CPU` on the CPU).
    `capacity` fixes the static caches' slots per row (at least the longest prompt + its budget +
    gamma + 2): calls of one batch size and capacity share compiled graphs, where by default
    (None) each call's need is rounded up to a power of two.

    `record=True` sets `result.record`: one `RowRecord` per prompt (`specdecode.decoding.record`),
    each step's drafts, accepted count, the target's correction or bonus token, which drafts prompt
    lookup filled, and when the host saw it. The loop keeps the step's tensors and syncs no more
    than without it. `on_step(event)` is called after every step with the tokens each row
    committed (a `StepEvent`), for views that stream: it costs one more host sync per step. Both
    need the eager core (`static=False`).
    """
    check_record(record, on_step, static)
    validate_models(target, drafter, prompt_lookup)
    compiled = check_core(static, compile, target.device, capacity)
    gamma = drafter_gamma(drafter) if gamma is None else gamma
    params, budgets, eos, prompts = validate_request(
        target, prompts, max_new_tokens, temperature, top_k, top_p, eos_token_ids, gamma=gamma
    )
    if capacity is not None:
        rows_capacity(prompts, budgets, gamma, capacity)  # holds the rows, before any work
    if max(budgets) == 0:
        return GenerationResult.empty(prompts, StepCounters(gamma, target.device), record)
    lookup = prompt_lookup if prompt_lookup is not None and prompt_lookup.applies(params.temperature) else None
    generator = _generator(seed, target.device)
    with folded_gqa(target, drafter):
        if static:
            return speculative_generate_static(
                target, drafter, prompts, budgets, eos, params, gamma, generator, lookup, compiled, capacity
            )
        return _speculative_eager(
            target, drafter, prompts, budgets, eos, params, gamma, generator, lookup, record=record, on_step=on_step
        )


def _speculative_eager(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    prompts: Sequence[Sequence[int]],
    budgets: list[int],
    eos: list[int],
    params: SamplingParams,
    gamma: int,
    generator: torch.Generator | None,
    lookup: PromptLookup | None,
    *,
    record: bool = False,
    on_step: Callable[[StepEvent], None] | None = None,
) -> GenerationResult:
    """The eager loop of `speculative_generate`, on checked arguments."""
    start = time.perf_counter()
    device = target.device
    batch = Batch.from_prompts(prompts, budgets, slack=gamma + 2, eos=eos, device=device)
    target_cache = RaggedKVCache.for_model(target, len(prompts), batch.capacity)
    drafting: Drafting = drafting_for(drafter, len(prompts), batch.capacity, lookup)
    features = drafting.feature_layers
    counters = StepCounters(gamma, device)
    recorder = Recorder(batch.prompt_lengths, start, on_step) if record or on_step is not None else None
    finisher = Finisher(len(prompts), recorder)

    # 0. prefill: the target's first token is an ordinary sample; the drafter only reads the prompt.
    first, hidden = prefill(target, target_cache, batch, feature_layers=features)
    drafting.prefill(batch.tokens, batch.lengths, max(batch.prompt_lengths), hidden)
    counters.record_target_call(len(prompts))
    counters.drafter_calls += 1
    first_token = next_tokens(first, params, generator)
    finished = batch.commit(first_token.unsqueeze(1), torch.ones_like(batch.lengths))
    if recorder is not None:
        recorder.add(batch.rows, batch.lengths, first_token)

    while (max_length := finisher.step(batch, finished, (target_cache, drafting))) is not None:
        target_cache.set_lengths(batch.lengths - 1, max_length - 1)

        # 1. draft gamma tokens, keeping q exactly as sampled from (None when greedy: not needed)
        draft, q = drafting.propose(batch.tokens, batch.lengths, max_length, gamma, params, generator)

        # 2. verify in one target pass: the pending token and the gamma drafts; 3. accept / resample
        num_accepted, next_token, new_tokens = verify_drafts(
            target, target_cache, drafting, batch.last(1), draft, q, batch.lengths - 1, params, generator
        )
        finished = batch.commit(new_tokens, num_accepted + 1)
        counters.record_step(num_accepted, drafter_calls=gamma)
        if recorder is not None:
            recorder.add(batch.rows, batch.lengths, next_token, draft, num_accepted, drafting.last_looked_up)

        # 4. trim caches: done at the top of the loop from the committed lengths (rejected drafts'
        # entries stay in their slots, masked, until overwritten).

    counters.looked_up = drafting.looked_up
    result = GenerationResult.build(finisher.sequences, counters, time.perf_counter() - start)
    result.record = recorder.rows() if record and recorder is not None else None
    return result


@torch.inference_mode()
def autoregressive_generate(
    target: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_ids: Sequence[int] | int | None = None,
    seed: int | None = None,
    feature_layers: Sequence[int] | None = None,
    static: bool = False,
    compile: bool | None = None,
    capacity: int | None = None,
    record: bool = False,
    on_step: Callable[[StepEvent], None] | None = None,
) -> GenerationResult:
    """Target-only decoding on the same caches, batching and stopping rules as `speculative_generate`.

    With `feature_layers`, `result.features[i]` `[len(prompts[i]) + len(sequences[i]), n·H]` (the
    target's dtype and device) holds the target's features (`target_features`) of prompt i's tokens
    and its continuation's, taken from the passes that wrote it: sequence-level distillation of a
    feature drafter then costs one target pass, not a second forward over the text. The last
    generated token is never fed (decoding stops once it is chosen), so its row is zero, as padding
    is: a feature drafter's training never reads a sequence's last feature (its last loss position
    predicts that token from the one before). `static` / `compile` / `record` / `on_step`: as for
    `speculative_generate` (every token's kind is `target`); `capacity` too, at least the longest
    prompt + its budget + 1."""
    check_record(record, on_step, static)
    compiled = check_core(static, compile, target.device, capacity)
    params, budgets, eos, prompts = validate_request(
        target, prompts, max_new_tokens, temperature, top_k, top_p, eos_token_ids
    )
    if capacity is not None:
        rows_capacity(prompts, budgets, None, capacity)  # holds the rows, before any work
    layers = check_feature_layers(feature_layers, target.config.num_hidden_layers)
    if max(budgets) == 0 and layers is None:
        return GenerationResult.empty(prompts, StepCounters(0, target.device), record)
    generator = _generator(seed, target.device)
    with folded_gqa(target):
        if static:
            return autoregressive_generate_static(
                target, prompts, budgets, eos, params, generator, layers, compiled, capacity
            )
        return _autoregressive_eager(target, prompts, budgets, eos, params, generator, layers, record, on_step)


def _autoregressive_eager(
    target: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    budgets: list[int],
    eos: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    layers: tuple[int, ...] | None,
    record: bool,
    on_step: Callable[[StepEvent], None] | None,
) -> GenerationResult:
    """`autoregressive_generate` on the eager ragged core, on checked arguments."""
    start = time.perf_counter()
    device = target.device
    batch = Batch.from_prompts(prompts, budgets, slack=1, eos=eos, device=device)
    cache = RaggedKVCache.for_model(target, len(prompts), batch.capacity)
    counters = StepCounters(0, device)
    recorder = Recorder(batch.prompt_lengths, start, on_step) if record or on_step is not None else None
    finisher = Finisher(len(prompts), recorder)

    logits, hidden = prefill(target, cache, batch, feature_layers=layers)
    features = FeatureRows(hidden, batch.capacity) if hidden is not None else None
    counters.record_target_call(len(prompts))
    token = next_tokens(logits, params, generator)
    finished = batch.commit(token.unsqueeze(1), torch.ones_like(batch.lengths))
    if recorder is not None:
        recorder.add(batch.rows, batch.lengths, token)
    while (max_length := finisher.step(batch, finished, (cache,))) is not None:
        cache.set_lengths(batch.lengths - 1, max_length - 1)
        out = cached_forward(target, cache, batch.last(1), feature_layers=layers)
        logits, hidden = out if layers is not None else (out, None)
        if features is not None:
            features.write(batch.rows, batch.lengths - 1, hidden[:, -1])
        token = next_tokens(logits[:, -1], params, generator)
        finished = batch.commit(token.unsqueeze(1), torch.ones_like(batch.lengths))
        counters.record_target_call(len(finished))
        if recorder is not None:
            recorder.add(batch.rows, batch.lengths, token)

    result = GenerationResult.build(finisher.sequences, counters, time.perf_counter() - start)
    result.record = recorder.rows() if record and recorder is not None else None
    if features is not None:
        result.features = features.rows(batch.prompt_lengths, result.sequences)
    return result
