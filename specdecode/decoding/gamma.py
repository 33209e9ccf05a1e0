"""The gamma a drafter decodes fastest at (`choose_gamma`), stored with the drafter
(`config.specdecode_gamma`, read back by `decode.drafter_gamma`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedModel

from specdecode.decoding.speedup import fastest_gamma, predicted_speedups
from specdecode.decoding.timing import (
    VERIFY_REPEATS,
    long_enough_context,
    measure_step_costs,
    measure_verify_ratios,
    timed_decodes,
)
from specdecode.models.feature_drafter import FeatureDrafter


def choose_gamma(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    context: Sequence[int],
    alpha: float,
    candidates: Sequence[int],
    prompts: Sequence[Sequence[int]] = (),
    max_new_tokens: int = 32,
    temperature: float = 0.0,
) -> dict[str, Any]:
    """The gamma of `candidates` that decodes fastest with `drafter`, and the figures that chose it
    (`{"chosen": gamma, "speedup": float, "method": ..., ...}`). With `prompts`: timed decodes (the
    verify timings Leviathan's model needs move by a third between processes on a shared CPU);
    without: the model at `alpha`, on step costs timed after `context`."""
    was_training = drafter.training
    drafter.eval()
    try:
        if prompts:
            return _from_timed_decodes(target, drafter, candidates, prompts, max_new_tokens, temperature) | {
                "alpha": alpha
            }
        return _from_the_model(target, drafter, context, alpha, candidates)
    finally:
        drafter.train(was_training)


def _from_timed_decodes(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    candidates: Sequence[int],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float,
) -> dict[str, Any]:
    timed = timed_decodes(target, drafter, prompts, candidates, max_new_tokens, temperature)
    speedups = {g: timed["autoregressive_s"] / s for g, s in timed["seconds"].items()}
    near = within_noise_of_fastest(timed["per_prompt_s"])
    gamma = min(near)  # the shortest drafts among those the timing cannot tell from the fastest
    return {
        "chosen": gamma,
        "speedup": speedups[gamma],
        "method": "timed decodes",
        "tau": timed["tau"],
        "measured_speedups": speedups,
        "within_noise_of_fastest": near,
        "seconds": timed["seconds"],
        "autoregressive_seconds": timed["autoregressive_s"],
        "prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "max_new_tokens": max_new_tokens,
    }


def _from_the_model(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    context: Sequence[int],
    alpha: float,
    candidates: Sequence[int],
) -> dict[str, Any]:
    context = long_enough_context(context, max(candidates))
    costs = measure_step_costs(target, drafter, context, 1, repeats=5)
    verify = measure_verify_ratios(target, context, candidates, VERIFY_REPEATS)
    speedups = predicted_speedups(min(max(alpha, 0.0), 1.0), costs.cost_ratio, verify)
    gamma = fastest_gamma(speedups)
    return {
        "chosen": gamma,
        "speedup": speedups[gamma],
        "alpha": alpha,
        "method": "Leviathan's model at alpha",
        "cost_ratio": costs.cost_ratio,
        "verify_ratios": verify,
        "predicted_speedups": speedups,
        "context_tokens": len(context),
    }


def within_noise_of_fastest(per_prompt_s: Mapping[int, Sequence[float]]) -> list[int]:
    """The gammas, ascending, whose mean per-prompt log time ratio to the fastest's is within one
    standard error (`per_prompt_s`: gamma → seconds per prompt)."""
    fastest = min(per_prompt_s, key=lambda g: (sum(per_prompt_s[g]), g))
    near = []
    for g, times in per_prompt_s.items():
        logs = [math.log(t / f) for t, f in zip(times, per_prompt_s[fastest])]
        error = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
        if g == fastest or statistics.fmean(logs) <= error:
            near.append(g)
    return sorted(near)
