"""specdecode: speculative decoding with trained, domain-specialised drafters."""

from specdecode.decode import autoregressive_generate, speculative_generate
from specdecode.sampling import SamplingParams, logits_to_probs, sample
from specdecode.stats import DecodeStats, GenerationResult
from specdecode.verify import rejection_sample

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
