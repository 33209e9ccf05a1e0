"""Prompt lookup: which token an earlier occurrence proposes, and when it replaces the drafter's.

(Exactness of decoding with it: tests/test_verify.py's Monte-Carlo tests and tests/test_decode.py's
greedy-vs-transformers tests run with lookup on.)
"""

from __future__ import annotations

import pytest
import torch

from specdecode import speculative_generate
from specdecode.decoding.lookup import PromptLookup, lookup, override_q
from tests.models_for_tests import tiny_llama

PAD = 99  # what lies past a row's length: must never be matched or proposed


def rows(*tokens: list[int], capacity: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `[B, capacity]` context and `[B]` lengths."""
    context = torch.full((len(tokens), capacity), PAD)
    for i, t in enumerate(tokens):
        context[i, : len(t)] = torch.tensor(t)
    return context, torch.tensor([len(t) for t in tokens])


def test_lookup_proposes_what_followed_the_most_recent_longest_match() -> None:
    context, lengths = rows(
        [5, 6, 7, 1, 5, 6, 8, 2, 5, 6],  # "5 6" twice before: the most recent was followed by 8
        [1, 2, 3, 9, 2, 3, 4, 1, 2, 3],  # "2 3" followed by 9 then 4, but "1 2 3" only by 9
        [4, 5, 6, 7],  # no earlier occurrence of any suffix
        [3, 3, 3],  # overlapping: "3 3" occurred at 0, followed by 3
    )
    found, token = lookup(context, lengths, max_ngram=3, min_ngram=2)
    assert found.tolist() == [True, True, False, True]
    assert token[found].tolist() == [8, 9, 3]


def test_lookup_reads_nothing_past_a_row() -> None:
    # Past the length the buffer holds "5 6 PAD" and "5 6 0": neither may match or be proposed.
    context = torch.tensor([[1, 5, 6, 2, 5, 6, PAD], [7, 7, 5, 6, 0, 0, 0]])
    found, token = lookup(context, torch.tensor([6, 4]), max_ngram=2, min_ngram=2)
    assert found.tolist() == [True, False]
    assert token[0].item() == 2
    # a suffix of the full buffer is not a row's suffix
    found, _ = lookup(context, torch.tensor([3, 2]), max_ngram=2, min_ngram=1)
    assert found.tolist() == [False, True] and _[1].item() == 7


def test_lookup_handles_rows_shorter_than_the_ngram() -> None:
    context, lengths = rows([4], [4, 4], capacity=3)
    found, token = lookup(context, lengths, max_ngram=4, min_ngram=1)
    assert found.tolist() == [False, True]
    assert token[1].item() == 4


def test_choose_overrides_only_unsure_rows_with_a_match() -> None:
    context, lengths = rows([1, 2, 1], [1, 2, 1], [3, 4, 5])
    sure = torch.tensor([4.0, 0.0, 0.0])  # softmax top ~0.87
    unsure = torch.zeros(3)  # top 1/3
    logits = torch.stack([sure, unsure, unsure])
    drafts = torch.tensor([0, 0, 0])
    chosen, used = PromptLookup(max_ngram=2, min_ngram=1, max_confidence=0.7).choose(logits, drafts, context, lengths)
    assert used.tolist() == [False, True, False]  # sure / unsure with a match / no match
    assert chosen.tolist() == [0, 2, 0]
    chosen, used = PromptLookup(max_ngram=2, min_ngram=1, max_confidence=1.0).choose(logits, drafts, context, lengths)
    assert chosen.tolist() == [2, 2, 0]
    chosen, used = PromptLookup(max_ngram=2, min_ngram=1, max_confidence=0.0).choose(logits, drafts, context, lengths)
    assert not used.any()


def test_override_q_makes_looked_up_drafts_one_hot() -> None:
    q = torch.full((2, 2, 4), 0.25)
    drafts = torch.tensor([[3, 1], [0, 2]])
    used = torch.tensor([[True, False], [False, True]])
    out = override_q(q, drafts, used)
    assert out[0, 0].tolist() == [0, 0, 0, 1] and out[1, 1].tolist() == [0, 0, 1, 0]
    assert torch.equal(out[0, 1], q[0, 1]) and torch.equal(out[1, 0], q[1, 0])


@pytest.mark.parametrize("temperature, used", [(0.0, True), (0.7, True), (1.0, False)])
def test_lookup_drafts_only_up_to_its_max_temperature(temperature, used) -> None:
    target = tiny_llama(2, seed=0)
    drafter = tiny_llama(1, seed=1)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2]]
    lookup = PromptLookup(max_ngram=3, min_ngram=1, max_confidence=1.0)  # max_temperature 0.7
    result = speculative_generate(
        target,
        drafter,
        prompts,
        gamma=2,
        max_new_tokens=8,
        temperature=temperature,
        eos_token_ids=[],
        seed=0,
        prompt_lookup=lookup,
    )
    assert (result.stats.looked_up > 0) == used


def test_disabled_lookup_decodes_as_the_drafter_alone() -> None:
    """`enabled=False` (the apps' `prompt_lookup.enabled: false`) is `prompt_lookup=None`."""
    target, drafter = tiny_llama(2, seed=0), tiny_llama(1, seed=1)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2]]
    off = PromptLookup(enabled=False, max_ngram=3, min_ngram=1, max_confidence=1.0)
    assert not off.applies(0.0) and PromptLookup(max_confidence=1.0).applies(0.0)
    results = [
        speculative_generate(
            target, drafter, prompts, gamma=2, max_new_tokens=8, eos_token_ids=[], prompt_lookup=lookup
        )
        for lookup in (off, None)
    ]
    assert results[0].stats.looked_up == 0 and results[0].sequences == results[1].sequences


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_ngram": 0},
        {"max_ngram": 1, "min_ngram": 2},
        {"max_confidence": 1.5},
        {"max_ngram": True},
        {"max_temperature": -1.0},
        {"max_temperature": float("nan")},
        {"enabled": "yes"},
    ],
)
def test_bad_settings_are_refused_naming_the_value(kwargs) -> None:
    with pytest.raises(ValueError, match=repr(next(iter(kwargs.values())))):
        PromptLookup(**kwargs)
