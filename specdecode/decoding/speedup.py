"""What speculative decoding should buy: Leviathan et al.'s speedup model with a measured verify
cost (the costs themselves are timed by `timing.py`; the gamma a drafter decodes with is chosen by
`gamma.py`).

Theorem 3.8 of Leviathan et al. (2023) assumes a verify pass of gamma + 1 tokens costs the same as
a one-token step. That holds on a GPU, not on a CPU (a 5-token verify there costs ~1.45x a step), so
the model here takes the measured verify cost instead:

    speedup = E[tokens per step] * T_target(1) / (gamma * T_drafter + T_target(gamma + 1)),
    E[tokens per step] = (1 - alpha^(gamma + 1)) / (1 - alpha).
"""

from __future__ import annotations

from collections.abc import Mapping


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """E[tokens per target pass] when each draft is accepted independently with probability alpha."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: int, cost_ratio: float, verify_ratio: float) -> float:
    """Speedup over target-only decoding (Leviathan Thm 3.8 with a measured verify cost).

    Args:
        alpha: per-token acceptance rate.
        gamma: drafts per step.
        cost_ratio: c = T_drafter(1 token) / T_target(1 token).
        verify_ratio: T_target(gamma + 1 tokens) / T_target(1 token); 1 recovers the paper's formula.
    """
    return expected_tokens_per_step(alpha, gamma) / (gamma * cost_ratio + verify_ratio)


def optimal_gamma(alpha: float, cost_ratio: float, verify_ratios: dict[int, float]) -> tuple[int, float]:
    """The gamma Leviathan's model predicts fastest, each gamma with its own measured verify cost.

    Args:
        alpha: per-token acceptance rate.
        cost_ratio: c, a drafter step relative to a target step.
        verify_ratios: gamma → T_target(gamma + 1 tokens) / T_target(1 token).

    Returns `(gamma, predicted speedup)`; a speedup below 1 says speculation does not pay at all.
    """
    if not verify_ratios:
        raise ValueError("verify_ratios is empty: measure at least one gamma")
    speedups = predicted_speedups(alpha, cost_ratio, verify_ratios)
    best = fastest_gamma(speedups)
    return best, speedups[best]


def predicted_speedups(alpha: float, cost_ratio: float, verify_ratios: Mapping[int, float]) -> dict[int, float]:
    """gamma → `predicted_speedup` at that gamma's own measured verify cost (`verify_ratios`)."""
    return {g: predicted_speedup(alpha, g, cost_ratio, v) for g, v in verify_ratios.items()}


def fastest_gamma(speedups: Mapping[int, float]) -> int:
    """The gamma with the highest speedup; ties: the shorter drafts."""
    return max(speedups, key=lambda g: (speedups[g], -g))
