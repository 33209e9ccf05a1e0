"""Leviathan et al.'s speedup model (2023, Thm 3.8) with a measured verify cost instead of one step
(on a CPU a 5-token verify costs ~1.45x a step):

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
    """Speedup over target-only decoding; `cost_ratio` c = T_drafter(1) / T_target(1),
    `verify_ratio` T_target(gamma + 1) / T_target(1) (1 recovers the paper's formula)."""
    return expected_tokens_per_step(alpha, gamma) / (gamma * cost_ratio + verify_ratio)


def optimal_gamma(alpha: float, cost_ratio: float, verify_ratios: dict[int, float]) -> tuple[int, float]:
    """`(gamma, predicted speedup)` of the fastest gamma, each at its own measured verify cost
    (`verify_ratios`: gamma → T_target(gamma + 1) / T_target(1)); below 1, speculation does not pay."""
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
