"""Prompt datasets of the drafter domains, their hash-based held-out split, and the tokenised text a
truncated vocabulary is picked from. Above `specdecode.core` only."""

from specdecode.data.config import DataConfig
from specdecode.data.corpus import vocab_corpus
from specdecode.data.domains import DOMAINS, format_prompt, is_heldout, load_domain, split_examples
from specdecode.data.embedded import synthetic_dataset
from specdecode.data.example import Example

__all__ = [
    "DOMAINS",
    "DataConfig",
    "Example",
    "format_prompt",
    "is_heldout",
    "load_domain",
    "split_examples",
    "synthetic_dataset",
    "vocab_corpus",
]
