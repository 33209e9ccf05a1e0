"""Simulated greedy decoding (router labels `decode_tau`): the passes counted from teacher-forced
draft matches equal the target calls `speculative_generate` makes, drafter by drafter."""

from __future__ import annotations

import pytest
import torch

from specdecode.data.example import Example
from specdecode.decoding.decode import speculative_generate
from specdecode.decoding.lookup import PromptLookup
from specdecode.models.feature_drafter import derive_feature_drafter
from specdecode.routing.labels import collect_labels, label_rows, teacher_forced_acceptance
from specdecode.routing.simulate import target_calls
from tests.models_for_tests import tiny_llama


def _table(*rows: str) -> torch.Tensor:
    return torch.tensor([[c == "T" for c in row] for row in rows])


@pytest.mark.parametrize(
    "rows, length, calls",
    [
        (("FFFFFF", "FFFFFF"), 6, 6),  # nothing matches: the prefill, then one token per pass
        (("TTTTTT", "TTTTTT"), 6, 3),  # 1 + (2 drafts + 1) + (2 drafts + 1, one past the end)
        # a pass from token 1 takes drafts 1..3 (depth 1 at 1, depth 2 at 2, depth 3 at 3), the next
        # from token 5 two of them: counting depth-1 matches alone would give 6 calls
        (("FTFFFTFF", "FFTFFFTF", "FFFTFFFF"), 8, 3),
        # a later draft counts only behind matching earlier ones
        (("FFFFFFFF", "FFTFFFTF", "FFFTFFFF"), 8, 8),
    ],
)
def test_target_calls_count_leading_matches_per_pass(rows: tuple[str, ...], length: int, calls: int) -> None:
    assert target_calls(_table(*rows), length) == calls


# Repetitive prompts, so that prompt lookup drafts too; the tiny vocabulary makes random drafters
# match often enough for passes to accept 0 to gamma drafts.
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [3, 9, 4, 3, 9, 4, 3, 9], [2, 8], [10, 11, 2, 10, 11, 2, 10, 4, 6]]


@pytest.mark.parametrize("lookup", [None, PromptLookup(max_confidence=0.9)])
def test_simulated_tau_equals_speculative_decoding(lookup: PromptLookup | None) -> None:
    target = tiny_llama(3, seed=2, vocab_size=12)
    # seeds where the feature drafter's later drafts decide some passes: counting its first drafts
    # alone gives 20 / 17 tokens per call on the third prompt instead of 20 / 15
    torch.manual_seed(3)
    feature = derive_feature_drafter(target, 1, draft_vocab=None)
    with torch.no_grad():
        feature.fc.weight.normal_(0, 0.3)
    drafters = [("feature", feature), ("slice", tiny_llama(1, seed=1, vocab_size=12)), ("self", target)]
    gammas = [3, 2, 4]
    labels = collect_labels(
        target, drafters, PROMPTS, max_new_tokens=20, batch_size=3, progress=False, lookup=lookup, gammas=gammas
    )
    assert labels.decode_tau is not None and labels.decode_tau.shape == (len(PROMPTS), 3)
    for k, ((name, drafter), gamma) in enumerate(zip(drafters, gammas)):
        for i, prompt in enumerate(PROMPTS):
            decoded = speculative_generate(
                target, drafter, [prompt], max_new_tokens=20, gamma=gamma, prompt_lookup=lookup
            )
            assert decoded.sequences[0] == labels.continuations[i]
            assert labels.decode_tau[i, k].item() == pytest.approx(decoded.stats.tau, abs=1e-6), (name, i)
    if lookup is None:
        # The target drafting for itself is always accepted: 5 tokens per pass after the prefill's 1.
        assert labels.decode_tau[:, 2].tolist() == pytest.approx([20 / 5] * len(PROMPTS))
    # Not a trivial case: some of the feature drafter's passes accept two drafts or more.
    assert (labels.decode_tau[:, 0] > 1.3).any()


def test_decode_labels_are_greedy_only_and_priced_per_pass() -> None:
    target = tiny_llama(3, seed=0, vocab_size=12)
    drafters = [("slice", tiny_llama(1, seed=1, vocab_size=12)), ("self", target)]
    sampled = collect_labels(
        target, drafters, PROMPTS, max_new_tokens=8, temperature=0.7, progress=False, gammas=[2, 3]
    )
    assert sampled.decode_tau is None
    assert teacher_forced_acceptance(target, [target], PROMPTS[:1], [[1, 2]], temperature=0.7, gammas=[2])[2] is None
    greedy = collect_labels(target, drafters, PROMPTS, max_new_tokens=8, progress=False, gammas=[2, 3])
    examples = [("train", Example(prompt=str(p), response=None, domain="code")) for p in PROMPTS]
    rows = label_rows(
        greedy, examples, [len(p) for p in PROMPTS], gammas=[2, 3], cost_ratios=[0.1, 0.5], verify_ratios=[1.2, 1.0]
    )
    for row, tau in zip(rows, greedy.decode_tau.tolist()):  # type: ignore[union-attr]
        assert row["decode_tau"] == pytest.approx({"slice": tau[0], "self": tau[1]}, abs=1e-6)
        # tokens per call over a pass's cost in target steps: verify + gamma drafter steps
        assert row["decode_speedup"] == pytest.approx({"slice": tau[0] / 1.4, "self": tau[1] / 2.5}, abs=1e-5)
    with pytest.raises(ValueError, match=r"gammas=\[2\]: one int >= 1 per drafter \(2\)"):
        collect_labels(target, drafters, PROMPTS, max_new_tokens=8, progress=False, gammas=[2])
