"""Speculative and autoregressive decoding: sampling, rejection sampling, the KV caches, how each
drafter kind drafts, the loop and its three decoders (eager, static, compiled), Leviathan's
speedup model, the timing of passes and decodes, and the gamma choice. Reads models
(`specdecode.models`), never trains or routes them."""

from specdecode.decoding.decode import (
    DEFAULT_GAMMA,
    DecodeOptions,
    autoregressive_generate,
    drafter_gamma,
    speculative_generate,
)
from specdecode.decoding.gamma import choose_gamma
from specdecode.decoding.sampling import SamplingParams, logits_to_probs, sample
from specdecode.decoding.speedup import optimal_gamma, predicted_speedup
from specdecode.decoding.stats import DecodeStats, GenerationResult
from specdecode.decoding.timing import StepCosts, measure_step_costs
from specdecode.decoding.verify import rejection_sample

__all__ = [
    "DEFAULT_GAMMA",
    "DecodeOptions",
    "DecodeStats",
    "GenerationResult",
    "SamplingParams",
    "StepCosts",
    "autoregressive_generate",
    "choose_gamma",
    "drafter_gamma",
    "logits_to_probs",
    "measure_step_costs",
    "optimal_gamma",
    "predicted_speedup",
    "rejection_sample",
    "sample",
    "speculative_generate",
]
