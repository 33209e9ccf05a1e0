"""The one timer: the wall time of cached forward passes (a target step, a verify of gamma + 1
tokens, a drafter step), of each decode core's pieces, and of whole batch-1 decodes, as the speedup
model (`speedup.py`), the gamma choice (`gamma.py`) and the benchmarks read them.

Everything timed here goes through `time_rounds`: the things it compares (widths, gammas, cores,
the target alone) take turns within each round, so a machine whose speed drifts (other tenants,
clock changes) biases all of them alike instead of skewing their ratios; the first rounds warm up
and are not counted.

Per core (`core_step_costs`), at batch 1 in the middle of an answer (the prompt plus half of
`new_tokens` committed), on the caches that core's decode gets:

* a target step: one token through the target, on a cache the size the target alone decodes with;
* a verify: the pending token and gamma drafts through the target, accepted greedily, the target's
  features kept where the drafter reads them (`verify_drafts`, as a round runs it);
* a draft: the drafting strategy's gamma drafts (`Drafting.propose`, as a round runs it); the
  drafter's step is a gamma-th of it (for a feature drafter that includes its first window, the
  gamma + 1 positions whose true features are new).

On the compiled core each of the three is its own compiled graph, so what a whole round fuses
across them is not in these figures; the decode benchmark times whole rounds. A core's first
`GUARDED_STEPS` rounds (compiling, guards) are not counted.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from specdecode.decoding.attention import folded_gqa
from specdecode.decoding.cache import RaggedKVCache, cached_call, cached_forward, cached_forward_features
from specdecode.decoding.compiled import check_core, compiled_function, mark_step, nested_layers, skipped_guards
from specdecode.decoding.costs import Piece, time_rounds
from specdecode.decoding.decode import autoregressive_generate, speculative_generate
from specdecode.decoding.drafting import Drafting, drafting_for
from specdecode.decoding.sampling import SamplingParams
from specdecode.decoding.static import GUARDED_STEPS
from specdecode.decoding.static_buffers import fresh_zeros, mark_static, static_zeros
from specdecode.decoding.static_cache import StaticKVCache, static_capacity
from specdecode.decoding.stats import GenerationResult
from specdecode.decoding.verify import verify_drafts
from specdecode.models.feature_drafter import FeatureDrafter

# Timed rounds behind a verify ratio (the gamma choice without prompts, the evaluation's pass
# costs). Each round times every width once, ~0.1 s for the embedded target on a 2-core CPU; with
# a few rounds a 4-token verify's ratio to a step moved by a third between processes.
VERIFY_REPEATS = 30
# The decode cores, as the options of `speculative_generate` / `autoregressive_generate`.
CORES: dict[str, dict[str, bool]] = {
    "eager": dict(static=False),
    "static": dict(static=True, compile=False),
    "compiled": dict(static=True, compile=True),
}
GREEDY = SamplingParams()


@dataclass
class StepCosts:
    """Median wall time of one cached forward pass at a given context length, in seconds."""

    target_step_s: float
    target_verify_s: float
    drafter_step_s: float
    gamma: int
    context_tokens: int
    # gamma → a (gamma + 1)-token verify over a one-token step, when measured (measure_verify_ratios).
    verify_ratios: dict[int, float] = field(default_factory=dict)

    @property
    def cost_ratio(self) -> float:
        """c: a drafter step relative to a target step."""
        return self.drafter_step_s / self.target_step_s

    @property
    def verify_ratio(self) -> float:
        """A (gamma + 1)-token verify pass relative to a one-token target step."""
        return self.target_verify_s / self.target_step_s

    def to_dict(self) -> dict[str, float]:
        return asdict(self) | {"cost_ratio": self.cost_ratio, "verify_ratio": self.verify_ratio}


def _time_forward(model: PreTrainedModel, context: Sequence[int], num_new: int, repeats: int) -> float:
    """Median time of a `num_new`-token pass after `context` (batch 1), on a warm cache."""
    return _time_forwards(model, context, [num_new], repeats)[num_new]


def _time_forwards(
    model: PreTrainedModel, context: Sequence[int], widths: Sequence[int], repeats: int
) -> dict[int, float]:
    """Median time of a pass of each of `widths` new tokens after `context` (batch 1, warm cache),
    the widths taking turns within each round."""
    device = model.device
    longest = max(widths)
    cache = RaggedKVCache.for_model(model, 1, len(context))
    tokens = torch.tensor([list(context)], device=device)
    cached_length = len(context) - longest
    cached_forward(model, cache, tokens[:, :cached_length], logits_to_keep=1)

    def piece(num_new: int) -> Piece:
        new = tokens[:, cached_length : cached_length + num_new]
        return (
            lambda: cache.set_lengths(torch.tensor([cached_length], device=device), cached_length),
            lambda: cached_forward(model, cache, new, logits_to_keep=0 if num_new > 1 else 1),
        )

    return time_rounds({n: piece(n) for n in widths}, repeats, device)


def _time_feature_step(drafter: FeatureDrafter, context: Sequence[int], repeats: int) -> float:
    """Median time of one feature-drafter drafting step (one position + its head) after `context`."""
    device = drafter.device
    cache = RaggedKVCache.for_model(drafter, 1, len(context) + 1)
    tokens = torch.tensor([list(context)], device=device)
    features = torch.randn(1, len(context), drafter.feature_width, device=device, dtype=drafter.dtype)
    cached_call(cache, len(context) - 1, drafter.dtype, lambda **kw: drafter(features[:, :-1], tokens[:, 1:], **kw))
    step: Piece = (
        lambda: cache.set_lengths(torch.tensor([len(context) - 1], device=device), len(context) - 1),
        lambda: drafter.logits(
            cached_call(cache, 1, drafter.dtype, lambda **kw: drafter(features[:, -1:], tokens[:, -1:], **kw))
        ),
    )
    return time_rounds({"step": step}, repeats, device)["step"]


@torch.inference_mode()
def measure_verify_ratios(
    target: PreTrainedModel, context: Sequence[int], gammas: Sequence[int], repeats: int = 5
) -> dict[int, float]:
    """gamma → the measured cost of a (gamma + 1)-token verify over a one-token step, after `context`."""
    if len(context) <= max(gammas) + 1:
        raise ValueError(f"context must be longer than max(gammas) + 1 = {max(gammas) + 1} tokens, got {len(context)}")
    with folded_gqa(target):  # the decode loops' attention
        times = _time_forwards(target, context, [1, *(g + 1 for g in gammas)], repeats)
    return {g: times[g + 1] / times[1] for g in gammas}


@torch.inference_mode()
def measure_step_costs(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    context: Sequence[int],
    gamma: int,
    repeats: int = 10,
) -> StepCosts:
    """Time a target step, a (gamma + 1)-token verify and a drafter step after `context` tokens."""
    if len(context) <= gamma + 1:
        raise ValueError(f"context must be longer than gamma + 1 = {gamma + 1} tokens, got {len(context)}")
    with folded_gqa(target, drafter):  # the decode loops' attention
        target_times = _time_forwards(target, context, [1, gamma + 1], repeats)
        drafter_step_s = (
            _time_feature_step(drafter, context, repeats)
            if isinstance(drafter, FeatureDrafter)
            else _time_forward(drafter, context, 1, repeats)
        )
    return StepCosts(
        target_step_s=target_times[1],
        target_verify_s=target_times[gamma + 1],
        drafter_step_s=drafter_step_s,
        gamma=gamma,
        context_tokens=len(context),
    )


@torch.inference_mode()
def measure_pass_costs(
    target: PreTrainedModel,
    drafters: Mapping[str, PreTrainedModel | FeatureDrafter],
    gammas: Mapping[str, int],
    context: Sequence[int],
    repeats: int = VERIFY_REPEATS,
) -> dict[str, float]:
    """name → one speculative pass of that drafter at `gammas[name]`, in target steps: a verify of
    gamma + 1 tokens plus gamma drafter steps, timed after `context` (each gamma's verify once, the
    same figure for every drafter at it)."""
    missing = sorted(set(drafters) - set(gammas))
    if not drafters or missing:
        raise ValueError(
            f"measure_pass_costs needs a gamma for each of one or more drafters: drafters={sorted(drafters)}, "
            f"gammas={dict(gammas)}" + (f", none for {missing}" if missing else "")
        )
    gammas = {name: gammas[name] for name in drafters}
    context = long_enough_context(context, max(gammas.values()))
    verify = measure_verify_ratios(target, context, sorted(set(gammas.values())), repeats)
    return {
        name: verify[gammas[name]] + gammas[name] * measure_step_costs(target, drafter, context, 1, repeats).cost_ratio
        for name, drafter in drafters.items()
    }


def long_enough_context(context: Sequence[int], gamma: int) -> list[int]:
    """`context`, repeated where it is too short to time a verify of gamma + 1 tokens after it."""
    context = list(context)
    if len(context) <= gamma + 1:
        context = (context * (gamma + 2))[: gamma + 2 + len(context)]
    return context


def warm_up_tokens(max_new_tokens: int, gammas: Sequence[int]) -> int:
    """An untimed warm-up decode's budget: two verifies of the widest of `gammas` (a width's first pass pays set-up)."""
    return min(max_new_tokens, 2 * max(gammas, default=1) + 2)


# A decode timed by `timed_decodes`: (prompt ids, new tokens) -> its result.
TimedRun = Callable[[list[int], int], GenerationResult]


def timed_decodes(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    prompts: Sequence[Sequence[int]],
    gammas: Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
) -> dict[str, Any]:
    """Decode each of `prompts` alone (batch 1, as users and the evaluation time it) with the target
    alone and with `drafter` at each of `gammas` (`speculative_generate`, prompt lookup as by
    default, a fixed budget, seeded when sampling), timing every decode.

    Each prompt runs all of them back to back, in an order rotated by one per prompt, so a machine
    whose speed drifts biases none of them (evenly when the prompts are a multiple of the runs).
    Each run decodes once, untimed, before (a verify width's first pass pays one-off kernel set-up).
    Counted and timed: what a one-pass timing of the verify leaves out is in it (prompt lookup's
    copies, the later drafts' lower acceptance, the prefill, the loop's own work, and a CPU's
    uneven cost per verify width).

    Returns:
        `{"autoregressive_s": float, "seconds": {gamma: float}, "per_prompt_s": {gamma: [float]},
        "tau": {gamma: float}, "tokens": int}`: seconds summed over the prompts (and each prompt's),
        tau each gamma's generated tokens over its target passes (the prefill counts as one, as in
        `DecodeStats.tau`).
    """
    rows = [list(p) for p in prompts]
    if (
        not rows
        or not gammas
        or isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 2
    ):
        raise ValueError(
            f"timed_decodes needs one or more prompts and gammas and max_new_tokens >= 2 (a verify after the "
            f"prefill), got {len(rows)} prompts, gammas={list(gammas)}, max_new_tokens={max_new_tokens!r}"
        )
    # key 0: the target alone, the baseline every gamma's speedup is measured against
    runs: dict[int, TimedRun] = {
        0: lambda ids, n: autoregressive_generate(
            target, [ids], max_new_tokens=n, temperature=temperature, seed=0, eos_token_ids=[]
        )
    }

    def ours(gamma: int) -> TimedRun:
        return lambda ids, n: speculative_generate(
            target, drafter, [ids], max_new_tokens=n, gamma=gamma, temperature=temperature, seed=0, eos_token_ids=[]
        )

    runs |= {g: ours(g) for g in gammas}
    for run in runs.values():  # warm-up, not counted
        run(rows[0], warm_up_tokens(max_new_tokens, gammas))
    seconds: dict[int, list[float]] = {key: [] for key in runs}
    passes = dict.fromkeys(runs, 0)
    tokens = dict.fromkeys(runs, 0)
    order = list(runs)
    for i, ids in enumerate(rows):
        for key in order[i % len(order) :] + order[: i % len(order)]:
            start = time.perf_counter()
            result = runs[key](ids, max_new_tokens)
            seconds[key].append(time.perf_counter() - start)
            passes[key] += result.stats.target_calls
            tokens[key] += len(result.sequences[0])
    return {
        "autoregressive_s": sum(seconds[0]),
        "seconds": {g: sum(seconds[g]) for g in gammas},
        "per_prompt_s": {g: seconds[g] for g in gammas},
        "tau": {g: tokens[g] / passes[g] for g in gammas},
        "tokens": tokens[0],
    }


def _target_step(target: PreTrainedModel, cache: RaggedKVCache | StaticKVCache, token: torch.Tensor) -> torch.Tensor:
    return cached_forward(target, cache, token).argmax(dim=-1)


def _verify(
    target: PreTrainedModel,
    cache: RaggedKVCache | StaticKVCache,
    drafting: Drafting,
    pending: torch.Tensor,
    draft: torch.Tensor,
    start: torch.Tensor,
) -> torch.Tensor:
    return verify_drafts(target, cache, drafting, pending, draft, None, start, GREEDY, None)[2]


def _draft(drafting: Drafting, tokens: torch.Tensor, lengths: torch.Tensor, length: int, gamma: int) -> torch.Tensor:
    return drafting.propose(tokens, lengths, length, gamma, GREEDY, None)[0]


def _pieces(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    tokens: torch.Tensor,
    length: int,
    gamma: int,
    core: str,
    step_capacity: int,
) -> dict[str, Piece]:
    """The target step, verify and draft of one core, after `length` committed `tokens` `[1, S_cap]`
    (the target's caches hold all but the last, as at the start of a round or step): the
    speculative pieces on caches of S_cap slots, the target's step on one of `step_capacity`, the
    sizes each static core's decode gets."""
    static, compile = CORES[core]["static"], CORES[core].get("compile", False)
    device, capacity = target.device, tokens.shape[1]
    cache_type, zeros = StaticKVCache if static else RaggedKVCache, static_zeros if compile else fresh_zeros
    cache, step_cache = (cache_type.for_model(target, 1, size, zeros) for size in (capacity, step_capacity))
    drafting = drafting_for(drafter, cache_type.for_model(drafter, 1, capacity, zeros), gamma=gamma)
    cached_forward(target, step_cache, tokens[:, : length - 1], 1)
    _, hidden = cached_forward_features(
        target, cache, tokens[:, : length - 1], 1, feature_layers=drafting.feature_layers
    )
    drafting.prefill(tokens, torch.tensor([length - 1], device=device), length - 1, hidden)
    if compile:
        mark_static(tokens)
    drafter_back = drafting.snapshot()  # its progress: `propose` moves it
    pending, draft = tokens[:, length - 1 : length], tokens[:, length : length + gamma]
    start, lengths = torch.tensor([length - 1], device=device), torch.tensor([length], device=device)

    def run(function: Callable, *args: object) -> Callable[[], torch.Tensor]:
        call = compiled_function(function, device) if compile else function
        return lambda: call(*args)

    def back(target_cache: RaggedKVCache | StaticKVCache) -> Callable[[], None]:
        return lambda: target_cache.set_lengths(start.clone(), length - 1)

    return {
        "step": (back(step_cache), run(_target_step, target, step_cache, pending)),
        "verify": (back(cache), run(_verify, target, cache, drafting, pending, draft, start)),
        "draft": (drafter_back, run(_draft, drafting, tokens, lengths, length, gamma)),
    }


def _time_pieces(
    pieces: dict[tuple[str, str], Piece],
    repeats: int,
    compiled: set[str],
    device: torch.device,
    models: tuple[torch.nn.Module, ...],
) -> dict[tuple[str, str], float]:
    """Median seconds of each (core, piece), the pieces taking turns within each round; the first
    `GUARDED_STEPS` rounds (compiling, then guarded, as a decode's first steps) are not counted.
    A compiled core's pieces run with the decoder layers of `models` marked as a decode's are
    (`nested_layers`)."""

    @contextlib.contextmanager
    def around(key: tuple[str, str], round_: int) -> Iterator[None]:
        on = key[0] in compiled
        with nested_layers(*(models if on else ())):
            mark_step(on, device)
            with skipped_guards(on and round_ >= GUARDED_STEPS):
                yield

    return time_rounds(pieces, repeats, device, GUARDED_STEPS, around)


@torch.inference_mode()
def core_step_costs(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    prompt: Sequence[int],
    new_tokens: int,
    gamma: int,
    cores: Sequence[str] = tuple(CORES),
    repeats: int = 10,
) -> dict[str, StepCosts]:
    """core → its `StepCosts` (c, the verify ratio) for `drafter` at `gamma`, at batch 1 with `prompt`
    and half of `new_tokens` committed, on caches as large as a decode of `new_tokens` after `prompt`
    gets (see the module docstring).

    Raises:
        ValueError: an unknown core, an empty prompt, gamma or new_tokens below 1 or repeats below 1.
        RuntimeError: a compiled core on a torch that cannot compile it (`compiled.check_core`).
    """
    unknown = [core for core in cores if core not in CORES]
    if unknown or not cores:
        raise ValueError(f"cores must be one or more of {list(CORES)}, got {list(cores)}")
    for name, value in (("gamma", gamma), ("new_tokens", new_tokens), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not prompt:
        raise ValueError("prompt must hold one or more tokens")
    compiled = {core for core in cores if check_core(CORES[core]["static"], CORES[core].get("compile"), target.device)}
    length = len(prompt) + max(new_tokens // 2, 1)
    # the slots a decode's static caches get: `slack` past the budget as in `static_cache.rows_capacity`
    capacity = static_capacity(len(prompt) + new_tokens + gamma + 2)
    step_capacity = static_capacity(len(prompt) + new_tokens + 1)
    ids = (list(prompt) * (capacity // len(prompt) + 1))[:capacity]
    tokens = torch.tensor([ids], device=target.device)
    with folded_gqa(target, drafter):
        pieces = {
            (core, name): piece
            for core in cores
            for name, piece in _pieces(target, drafter, tokens.clone(), length, gamma, core, step_capacity).items()
        }
        times = _time_pieces(pieces, repeats, compiled, target.device, (target, drafter))
    return {
        core: StepCosts(
            target_step_s=times[core, "step"],
            target_verify_s=times[core, "verify"],
            drafter_step_s=times[core, "draft"] / gamma,
            gamma=gamma,
            context_tokens=length,
        )
        for core in cores
    }
