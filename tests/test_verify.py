"""Rejection sampling as a pure function, and a Monte-Carlo check that decoding follows the target.

The distribution tests use a G-test at significance 0.001: a correct sampler fails one with
probability 1/1000 per seed (they are seeded, so a pass is reproducible), and the planted-bug test
shows the same test has the power to catch a realistic mistake.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from scipy.stats import chi2

import specdecode.decoding.decode
import specdecode.decoding.drafting
import specdecode.decoding.verify
from specdecode import GenerationResult, speculative_generate
from specdecode.decoding.lookup import DEFAULT_LOOKUP, PromptLookup
from specdecode.decoding.sampling import SamplingParams, logits_to_probs, sample
from specdecode.decoding.verify import greedy_accept, rejection_sample
from tests.models_for_tests import tiny_llama
from tests.test_feature_drafter import random_feature_drafter

SIGNIFICANCE = 1e-3


def g_test_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """G-test of counts against exact probabilities; cells expected below `min_expected` are pooled.

    Raises AssertionError if a zero-probability cell was observed (that is never sampling noise).
    """
    n = observed.sum()
    assert observed[expected_probs == 0].sum() == 0, "sampled a token of zero target probability"
    expected = expected_probs * n
    small = expected < min_expected
    obs = torch.cat([observed[~small], observed[small].sum().view(1)]).double()
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]).double()
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    g = 2 * torch.sum(torch.where(obs > 0, obs * torch.log(obs / exp), torch.zeros_like(obs)))
    return float(chi2.sf(g.item(), df=len(obs) - 1))


# --- the pure function ----------------------------------------------------------------------------


def test_identical_distributions_accept_everything() -> None:
    q = torch.softmax(torch.randn(5, 3, 10), -1)
    p = torch.cat([q, torch.softmax(torch.randn(5, 1, 10), -1)], dim=1)
    draft = sample(q, torch.Generator().manual_seed(0))
    num_accepted, _ = rejection_sample(draft, q, p, torch.Generator().manual_seed(1))
    assert num_accepted.tolist() == [3] * 5


def test_greedy_accepts_exactly_the_matching_prefix() -> None:
    vocab = 6
    target_argmax = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    draft = torch.tensor([[1, 2, 5], [0, 2, 3]])
    p = torch.nn.functional.one_hot(target_argmax, vocab).float()
    q = torch.nn.functional.one_hot(draft, vocab).float()
    num_accepted, next_token = rejection_sample(draft, q, p)
    assert num_accepted.tolist() == [2, 0]
    assert next_token.tolist() == [3, 1]
    num_accepted, next_token = rejection_sample(draft, q, p, greedy=True)
    assert num_accepted.tolist() == [2, 0]
    assert next_token.tolist() == [3, 1]  # the target's own choice at the first mismatch


def test_greedy_accept_is_rejection_sampling_with_one_hot_distributions() -> None:
    """The decode loop's greedy path compares tokens instead of building one-hot p and q: on random
    drafts and argmaxes (every prefix length, the bonus token included) it must agree exactly."""
    generator = torch.Generator().manual_seed(0)
    vocab, gamma = 4, 3  # a small vocabulary, so that many drafts match
    draft = torch.randint(vocab, (500, gamma), generator=generator)
    target_argmax = torch.randint(vocab, (500, gamma + 1), generator=generator)
    target_argmax[:100, :gamma] = draft[:100]  # all accepted: the bonus token
    p = torch.nn.functional.one_hot(target_argmax, vocab).float()
    q = torch.nn.functional.one_hot(draft, vocab).float()
    expected = rejection_sample(draft, q, p, greedy=True)
    ours = greedy_accept(draft, target_argmax)
    assert set(ours[0].tolist()) == set(range(gamma + 1))
    assert torch.equal(ours[0], expected[0]) and torch.equal(ours[1], expected[1])


def test_all_zero_residual_falls_back_to_p() -> None:
    """p <= q everywhere yet p(x) < q(x): max(0, p - q) has no mass (in practice only through
    rounding, when p and q agree almost to the last bit). The resample must still be a valid token."""
    q = torch.tensor([[[0.5, 0.5]]]).expand(1000, 1, 2)
    p = torch.tensor([[[0.1, 0.5], [0.5, 0.5]]]).expand(1000, 2, 2)
    draft = torch.zeros(1000, 1, dtype=torch.long)
    num_accepted, next_token = rejection_sample(draft, q, p, torch.Generator().manual_seed(0))
    rejected = next_token[num_accepted == 0]
    assert 700 < rejected.numel() < 900  # rejection probability 1 - 0.1 / 0.5
    assert set(rejected.tolist()) <= {0, 1}
    # The fallback resamples from p = (0.1, 0.5): token 1 five times in six.
    assert 0.75 < (rejected == 1).float().mean() < 0.9


@pytest.mark.parametrize("seed", [0, 1])
def test_one_step_output_follows_p(seed) -> None:
    """Accepted-or-resampled token at position 0 is distributed as p_0, whatever q is."""
    generator = torch.Generator().manual_seed(seed)
    n, vocab = 200_000, 5
    p0 = torch.tensor([0.1, 0.4, 0.0, 0.3, 0.2])
    q0 = torch.tensor([0.3, 0.1, 0.2, 0.0, 0.4])
    q = q0.expand(n, 1, vocab)
    p = torch.stack([p0, torch.full((vocab,), 0.2)]).expand(n, 2, vocab)
    draft = sample(q, generator)
    num_accepted, next_token = rejection_sample(draft, q, p, generator)
    first = torch.where(num_accepted > 0, draft[:, 0], next_token)
    assert g_test_pvalue(torch.bincount(first, minlength=vocab), p0) > SIGNIFICANCE


# --- end to end: the decode loop's samples follow the target --------------------------------------

VOCAB, N_TOKENS, N_SAMPLES = 5, 3, 6000
PROMPT = [1, 3, 2]


@pytest.fixture(scope="module")
def mc_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    return tiny_llama(2, seed=11, vocab_size=VOCAB, init=0.3), tiny_llama(1, seed=12, vocab_size=VOCAB, init=0.3)


@torch.inference_mode()
def exact_joint(target: torch.nn.Module, params: SamplingParams, prompt: list[int] = PROMPT) -> torch.Tensor:
    """P(first N_TOKENS generated tokens after `prompt`) `[V ** N_TOKENS]`, by enumerating every prefix."""
    joint = torch.zeros([VOCAB] * N_TOKENS)
    for prefix in itertools.product(range(VOCAB), repeat=N_TOKENS - 1):
        logits = target(torch.tensor([prompt + list(prefix)])).logits[0, len(prompt) - 1 :]
        probs = logits_to_probs(logits, params)
        prob = 1.0
        for i, token in enumerate(prefix):
            prob *= probs[i, token].item()
        joint[prefix] = prob * probs[N_TOKENS - 1]
    return joint.flatten()


def sampled_joint(
    target: torch.nn.Module,
    drafter: torch.nn.Module,
    params: SamplingParams,
    seed: int,
    lookup: PromptLookup | None = DEFAULT_LOOKUP,
) -> torch.Tensor:
    result = mc_generate(target, drafter, params, seed, gamma=3, prompt_lookup=lookup)
    if lookup is EAGER_LOOKUP:
        # the eager lookup must really replace drafts, or the tests using it test nothing
        assert result.stats.looked_up > N_SAMPLES // 2
    return joint_counts(result.sequences)


def mc_generate(
    target: torch.nn.Module, drafter: Any, params: SamplingParams, seed: int, **kwargs: Any
) -> GenerationResult:
    """N_SAMPLES decodes of N_TOKENS tokens after PROMPT at `params`, no EOS; `kwargs` (gamma, ...)
    go to `speculative_generate`."""
    return speculative_generate(
        target,
        drafter,
        [PROMPT] * N_SAMPLES,
        max_new_tokens=N_TOKENS,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        eos_token_ids=[],
        seed=seed,
        **kwargs,
    )


def follows_target(sequences: list[list[int]], target: torch.nn.Module, params: SamplingParams) -> bool:
    """Whether the G-test passes `sequences` (N_TOKENS each, after PROMPT) as draws from the target."""
    return g_test_pvalue(joint_counts(sequences), exact_joint(target, params)) > SIGNIFICANCE


def joint_counts(sequences: list[list[int]]) -> torch.Tensor:
    """Counts `[V ** N_TOKENS]` of the generated N_TOKENS-token sequences."""
    codes = torch.tensor([sum(t * VOCAB ** (N_TOKENS - 1 - i) for i, t in enumerate(s)) for s in sequences])
    return torch.bincount(codes, minlength=VOCAB**N_TOKENS)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(1.0),
        SamplingParams(0.7, top_k=3),
        SamplingParams(1.3, top_p=0.8),
        SamplingParams(1.0, top_k=4, top_p=0.9),
    ],
    ids=["t1.0", "t0.7-k3", "t1.3-p0.8", "t1.0-k4-p0.9"],
)
def test_sampled_output_follows_target(mc_models, params) -> None:
    target, drafter = mc_models
    observed = sampled_joint(target, drafter, params, seed=0)
    assert g_test_pvalue(observed, exact_joint(target, params)) > SIGNIFICANCE


def test_distribution_test_catches_resampling_from_p(mc_models, monkeypatch) -> None:
    """Planted bug: at a rejection, resample from p instead of norm(max(0, p - q))."""

    def buggy(draft_tokens, q, p, generator=None, greedy=False):
        num_accepted, _ = rejection_sample(draft_tokens, q, p, generator, greedy)
        at_n = num_accepted.view(-1, 1, 1).expand(-1, 1, p.shape[-1])
        return num_accepted, sample(p.gather(1, at_n).squeeze(1), generator)

    monkeypatch.setattr(specdecode.decoding.verify, "rejection_sample", buggy)
    target, drafter = mc_models
    params = SamplingParams(1.0)
    observed = sampled_joint(target, drafter, params, seed=0)
    assert g_test_pvalue(observed, exact_joint(target, params)) < SIGNIFICANCE


# Looks up wherever a single earlier token matches, whatever the drafter's confidence and the
# temperature: on these 3-token prompts most drafts then come from the lookup, with q one-hot at them.
EAGER_LOOKUP = PromptLookup(max_ngram=2, min_ngram=1, max_confidence=1.0, max_temperature=2.0)


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=3)], ids=["t1.0", "t0.7-k3"])
def test_sampled_output_follows_target_with_prompt_lookup(mc_models, params) -> None:
    target, drafter = mc_models
    observed = sampled_joint(target, drafter, params, seed=2, lookup=EAGER_LOOKUP)
    assert g_test_pvalue(observed, exact_joint(target, params)) > SIGNIFICANCE


def test_distribution_test_catches_a_looked_up_draft_judged_by_the_drafters_q(mc_models, monkeypatch) -> None:
    """Planted bug: a looked-up draft keeps the drafter's q instead of a one-hot at itself."""
    monkeypatch.setattr(specdecode.decoding.drafting, "override_q", lambda q, drafts, used: q)
    target, drafter = mc_models
    params = SamplingParams(1.0)
    observed = sampled_joint(target, drafter, params, seed=2, lookup=EAGER_LOOKUP)
    assert g_test_pvalue(observed, exact_joint(target, params)) < SIGNIFICANCE


@pytest.mark.parametrize(
    "params, draft_vocab",
    [
        (SamplingParams(1.0), None),
        (SamplingParams(0.7, top_k=3), None),
        (SamplingParams(1.0), [0, 2, 3]),
        (SamplingParams(0.7, top_k=2), [0, 2, 3]),
    ],
    ids=["t1.0", "t0.7-k3", "t1.0-vocab3", "t0.7-k2-vocab3"],
)
def test_sampled_output_follows_target_with_a_feature_drafter(mc_models, params, draft_vocab) -> None:
    """The same Monte-Carlo test with an EAGLE-style drafter reading the target's features, with
    the full vocabulary and a truncated one (its q is computed over the draft ids, then spread)."""
    target, _ = mc_models
    drafter = mc_feature_drafter(target, draft_vocab)
    observed = sampled_joint(target, drafter, params, seed=1)
    assert g_test_pvalue(observed, exact_joint(target, params)) > SIGNIFICANCE
    # and with most drafts looked up: over a truncated vocabulary a looked-up id may lie outside it
    observed = sampled_joint(target, drafter, params, seed=3, lookup=EAGER_LOOKUP)
    assert g_test_pvalue(observed, exact_joint(target, params)) > SIGNIFICANCE


def mc_feature_drafter(target: torch.nn.Module, draft_vocab: list[int] | None = None) -> torch.nn.Module:
    """The MC tests' feature drafter: random fusion (seed 13, std 0.3), so its drafts depend on the
    features it reads."""
    return random_feature_drafter(target, seed=13, std=0.3, draft_vocab=draft_vocab)


# A second prompt, longer than PROMPT: in one batch with it the rows' caches, positions and the
# target features handed to the drafter are ragged.
LONGER_PROMPT = [4, 0, 1, 3, 3, 2, 0]


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=3)], ids=["t1.0", "t0.7-k3"])
def test_feature_drafter_samples_follow_the_target_in_a_ragged_batch(mc_models, params) -> None:
    """Rows of two prompt lengths, interleaved in one batch: each prompt's rows follow the target's
    distribution after that prompt."""
    target, _ = mc_models
    result = speculative_generate(
        target,
        mc_feature_drafter(target),
        [PROMPT, LONGER_PROMPT] * (N_SAMPLES // 2),
        gamma=3,
        max_new_tokens=N_TOKENS,
        temperature=params.temperature,
        top_k=params.top_k,
        eos_token_ids=[],
        seed=4,
    )
    assert result.stats.accepted > 0
    for first, prompt in enumerate([PROMPT, LONGER_PROMPT]):
        observed = joint_counts(result.sequences[first::2])
        assert g_test_pvalue(observed, exact_joint(target, params, prompt)) > SIGNIFICANCE


# Decodes one prompt at a time are slow next to one wide batch: fewer samples, the same test.
N_SINGLE = 1200


def test_feature_drafter_samples_follow_the_target_at_batch_1(mc_models) -> None:
    """One row per call (seeds 0..N_SINGLE-1): the batch-1 path, whose caches are never padded."""
    target, _ = mc_models
    drafter = mc_feature_drafter(target)
    params = SamplingParams(1.0)
    sequences, accepted = [], 0
    for seed in range(N_SINGLE):
        result = speculative_generate(
            target,
            drafter,
            [LONGER_PROMPT],
            gamma=3,
            max_new_tokens=N_TOKENS,
            temperature=params.temperature,
            eos_token_ids=[],
            seed=seed,
        )
        sequences += result.sequences
        accepted += result.stats.accepted
    assert accepted > 0
    assert g_test_pvalue(joint_counts(sequences), exact_joint(target, params, LONGER_PROMPT)) > SIGNIFICANCE
