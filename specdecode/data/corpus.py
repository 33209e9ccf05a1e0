"""Tokenised domain text: what a drafter with a truncated vocabulary must be able to speak."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from specdecode.data.domains import DOMAINS, load_domain


def vocab_corpus(
    tokenizer: PreTrainedTokenizerBase, docs_per_domain: int, *, source: str = "embedded", domains: Sequence[str] = DOMAINS
) -> list[list[int]]:
    """Tokenised training text of the domains (prompts and responses): what a drafter must speak."""
    corpus = []
    for domain in domains:
        for ex in load_domain(domain, source=source, split="train", limit=docs_per_domain):  # type: ignore[arg-type]
            corpus.append(tokenizer(ex.prompt + "\n" + (ex.response or ""))["input_ids"])
    return corpus
