"""Timing harness: the wall time of cached forward passes (a target step, a verify of gamma + 1
tokens, a drafter step) and of whole batch-1 decodes, as the speedup model (`speedup.py`) and the
gamma choice (`gamma.py`) read them.

Every harness here lets the things it compares take turns within each round (widths, gammas, the
target alone), so a machine whose speed drifts (other tenants, clock changes) biases all of them
alike instead of skewing their ratios; the first round warms up and is not counted.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from specdecode.decoding.attention import folded_gqa
from specdecode.decoding.cache import RaggedKVCache, cached_call, cached_forward
from specdecode.decoding.decode import autoregressive_generate, speculative_generate
from specdecode.decoding.stats import GenerationResult
from specdecode.models.feature_drafter import FeatureDrafter

# Timed rounds behind a verify ratio (the gamma choice without prompts, the evaluation's pass
# costs). Each round times every width once, ~0.1 s for the embedded target on a 2-core CPU; with
# a few rounds a 4-token verify's ratio to a step moved by a third between processes.
VERIFY_REPEATS = 30


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
    times: dict[int, list[float]] = {n: [] for n in widths}
    for _ in range(repeats + 1):  # the first round warms up and is not counted
        for num_new in widths:
            cache.set_lengths(torch.tensor([cached_length], device=device), cached_length)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            logits = cached_forward(
                model, cache, tokens[:, cached_length : cached_length + num_new], logits_to_keep=0 if num_new > 1 else 1
            )
            logits.sum().item()  # wait for the device
            times[num_new].append(time.perf_counter() - start)
    return {n: statistics.median(t[1:]) for n, t in times.items()}


def _time_feature_step(drafter: FeatureDrafter, context: Sequence[int], repeats: int) -> float:
    """Median time of one feature-drafter drafting step (one position + its head) after `context`."""
    device = drafter.device
    cache = RaggedKVCache.for_model(drafter, 1, len(context) + 1)
    tokens = torch.tensor([list(context)], device=device)
    features = torch.randn(1, len(context), drafter.feature_width, device=device, dtype=drafter.dtype)
    cached_call(cache, len(context) - 1, drafter.dtype, lambda **kw: drafter(features[:, :-1], tokens[:, 1:], **kw))
    times = []
    for _ in range(repeats + 1):  # the first pass warms up and is not counted
        cache.set_lengths(torch.tensor([len(context) - 1], device=device), len(context) - 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = cached_call(cache, 1, drafter.dtype, lambda **kw: drafter(features[:, -1:], tokens[:, -1:], **kw))
        drafter.logits(out).sum().item()  # wait for the device
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


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
    target: PreTrainedModel, drafter: PreTrainedModel, context: Sequence[int], gamma: int, repeats: int = 10
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
    prompts = [list(p) for p in prompts]
    if (
        not prompts
        or not gammas
        or isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 2
    ):
        raise ValueError(
            f"timed_decodes needs one or more prompts and gammas and max_new_tokens >= 2 (a verify after the "
            f"prefill), got {len(prompts)} prompts, gammas={list(gammas)}, max_new_tokens={max_new_tokens!r}"
        )
    # key 0: the target alone, the baseline every gamma's speedup is measured against
    runs: dict[int, TimedRun] = {
        0: lambda ids, n: autoregressive_generate(
            target, [ids], max_new_tokens=n, temperature=temperature, seed=0, eos_token_ids=[]
        )
    }
    for g in gammas:
        runs[g] = lambda ids, n, g=g: speculative_generate(
            target, drafter, [ids], max_new_tokens=n, gamma=g, temperature=temperature, seed=0, eos_token_ids=[]
        )
    for run in runs.values():  # warm-up, not counted
        run(prompts[0], warm_up_tokens(max_new_tokens, gammas))
    seconds: dict[int, list[float]] = {key: [] for key in runs}
    passes = dict.fromkeys(runs, 0)
    tokens = dict.fromkeys(runs, 0)
    order = list(runs)
    for i, ids in enumerate(prompts):
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
