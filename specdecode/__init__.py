"""specdecode: speculative decoding with trained, domain-specialised drafters."""

from specdecode.decoding.decode import autoregressive_generate, speculative_generate
from specdecode.decoding.sampling import SamplingParams, logits_to_probs, sample
from specdecode.decoding.stats import DecodeStats, GenerationResult
from specdecode.decoding.verify import rejection_sample

__all__ = [
    "DecodeStats",
    "GenerationResult",
    "SamplingParams",
    "autoregressive_generate",
    "logits_to_probs",
    "rejection_sample",
    "sample",
    "speculative_generate",
]
