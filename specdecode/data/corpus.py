"""Tokenised domain text: what a drafter with a truncated vocabulary must be able to speak."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase

from specdecode.data.domains import DOMAINS, load_domain
from specdecode.data.registry import domain_examples

# Documents per domain tokenised to pick a derived drafter's truncated vocabulary.
VOCAB_CORPUS_DOCS = 2000


def vocab_corpus(
    tokenizer: PreTrainedTokenizerBase, docs_per_domain: int, data: Mapping[str, Any] | None = None
) -> list[list[int]]:
    """Tokenised training text (prompts and responses) of each domain in `data` (name → data
    config), or of the built-in domains' embedded data: what a drafter must speak."""
    parts = (
        [domain_examples(spec, "train", docs_per_domain) for spec in data.values()]
        if data
        else [load_domain(domain, split="train", limit=docs_per_domain) for domain in DOMAINS]
    )
    return [tokenizer(ex.prompt + "\n" + (ex.response or ""))["input_ids"] for part in parts for ex in part]
