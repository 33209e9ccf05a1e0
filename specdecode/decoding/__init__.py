"""Speculative and autoregressive decoding: sampling, rejection sampling, the KV caches, drafting,
the loop and its three decoders (eager, static, compiled), step costs and the gamma choice. Reads
models (`specdecode.models`), never trains or routes them."""

from specdecode.decoding.adaptive import AdaptiveGamma
from specdecode.decoding.costs import StepTable, step_table
from specdecode.decoding.decode import (
    AUTO,
    DEFAULT_GAMMA,
    DecodeOptions,
    adaptive_gamma,
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
    "AUTO",
    "AdaptiveGamma",
    "DEFAULT_GAMMA",
    "DecodeOptions",
    "DecodeStats",
    "GenerationResult",
    "SamplingParams",
    "StepCosts",
    "StepTable",
    "adaptive_gamma",
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
    "step_table",
]
