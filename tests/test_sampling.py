"""logits → probabilities: the one distribution both drafter and target sample from."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdecode.decoding.sampling import SamplingParams, logits_to_probs, sample


def transformers_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 7, 0.6)])
def test_matches_transformers_warpers(temperature, top_k, top_p) -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    ours = logits_to_probs(logits, SamplingParams(temperature, top_k, top_p))
    torch.testing.assert_close(ours, transformers_probs(logits, temperature, top_k, top_p))
    assert ours.dtype == torch.float32


def test_greedy_is_one_hot_at_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 1.0, 4.9]], dtype=torch.bfloat16)
    probs = logits_to_probs(logits, SamplingParams())
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_minus_inf_logits_get_zero_probability() -> None:
    logits = torch.tensor([[float("-inf"), 1.0, 2.0, float("-inf")]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.9))
    assert probs[0, 0] == 0 and probs[0, 3] == 0 and torch.isfinite(probs).all()


def test_sample_follows_probs_and_never_picks_zero_mass() -> None:
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2]).expand(200_000, 4)
    draws = sample(probs, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert freq[1] == 0
    torch.testing.assert_close(freq, probs[0], atol=5e-3, rtol=0)


@pytest.mark.parametrize(
    "kwargs, needle", [(dict(temperature=-1.0), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p")]
)
def test_bad_params_are_named(kwargs, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(temperature=float("nan")), "nan"),
        (dict(temperature=float("inf")), "inf"),
        (dict(top_p=float("nan")), "nan"),
    ],
)
def test_non_finite_params_are_named(kwargs, needle) -> None:
    with pytest.raises(ValueError, match=f"got {needle}"):
        SamplingParams(**kwargs)
