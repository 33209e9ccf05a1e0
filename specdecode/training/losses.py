"""Token-level distillation losses between a drafter q and a target p (DistillSpec, Zhou et al.
2023): pure functions over logits `[B, T, V]` (`token_loss`). Sum them with `reduction="sum"` and
divide by the global `token_count`. Where q = 0 (`-inf` logits outside a truncated vocabulary)
0 · log 0 is 0, with the `-inf` replaced *before* the product so gradients stay finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

Reduction = Literal["mean", "sum"]
Loss = Callable[..., torch.Tensor]

# Forward KL is infinite where p > 0 = q: that log q = -inf is replaced by log(1e-8), a penalty that
# changes the value, never the gradient. Finite log q stay as they are, even below it: a clamp
# would zero the gradient of the tokens the drafter rates lowest, the ones it most needs to learn.
LOG_PROB_FLOOR = math.log(1e-8)


def _temperature(temperature: float) -> float:
    """The temperature the loss divides logits by: 0 (greedy decoding, no distribution to match)
    maps to 1, which keeps the argmax and gives a smooth loss."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    return 1.0 if temperature == 0 else float(temperature)


def _log_probs(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check the shapes and return `(log_q, log_p, keep)`: fp32 `[B, T, V]` and the bool mask `[B, T]`."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student_logits {tuple(student_logits.shape)} and teacher_logits "
            f"{tuple(teacher_logits.shape)} must have the same shape [B, T, V]"
        )
    if student_logits.dim() < 1 or student_logits.shape[-1] == 0:
        raise ValueError(f"logits need a non-empty vocabulary axis, got {tuple(student_logits.shape)}")
    if mask is None:
        keep = torch.ones(student_logits.shape[:-1], dtype=torch.bool, device=student_logits.device)
    else:
        if mask.shape != student_logits.shape[:-1]:
            raise ValueError(
                f"mask {tuple(mask.shape)} must match the logits' leading shape {tuple(student_logits.shape[:-1])}"
            )
        keep = mask.to(device=student_logits.device, dtype=torch.bool)
    tau = _temperature(temperature)
    # Masked-out positions (padding) may hold all -inf rows, whose log_softmax is NaN and whose
    # NaN gradient would reach the logits even through a masked sum; zero logits there instead.
    # fp32 because a bf16 log_softmax over a 100k+ vocabulary rounds away the tail the KLs weigh.
    log_q = torch.where(keep.unsqueeze(-1), student_logits.float(), 0.0).div(tau).log_softmax(-1)
    log_p = torch.where(keep.unsqueeze(-1), teacher_logits.float(), 0.0).div(tau).log_softmax(-1)
    return log_q, log_p, keep


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) = Σ_v a (log a - log b): `[B, T, V]` log-probs → `[B, T]`; 0 · log 0 = 0, and
    where a > 0 = b, log b = -inf is replaced by `LOG_PROB_FLOOR`."""
    a = log_a.exp()
    support = a > 0
    safe_log_a = torch.where(support, log_a, 0.0)
    safe_log_b = torch.where(torch.isneginf(log_b), LOG_PROB_FLOOR, log_b)
    return torch.where(support, a * (safe_log_a - safe_log_b), 0.0).sum(-1)


def _reduce(per_position: torch.Tensor, keep: torch.Tensor, reduction: Reduction) -> torch.Tensor:
    """Sum `[B, T]` over kept positions, or average it per kept token (0 when none is kept)."""
    total = torch.where(keep, per_position, 0.0).sum()
    if reduction == "sum":
        return total
    if reduction == "mean":
        return total / keep.sum().clamp_min(1)
    raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")


def token_count(mask: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
    """The positions a `reduction="sum"` loss added up (`mask` `[B, T]`, None: all of `logits`
    `[B, T, V]`): a 0-d int64 tensor on the logits' device, all-reduced without a host sync."""
    if mask is None:
        return torch.tensor(math.prod(logits.shape[:-1]), device=logits.device)
    return mask.to(torch.bool).sum()


def token_loss(per_position: Callable[..., torch.Tensor]) -> Loss:
    """The loss `fn(student_logits, teacher_logits, mask=None, *, temperature=1.0, reduction="mean",
    **options)` → 0-d fp32, whose value at each position is `per_position(log_q, log_p, **options)`
    (`[B, T, V]` fp32 log-probabilities → `[B, T]`). Logits q, p `[B, T, V]` (`-inf` allowed), both
    divided by `temperature` (0 uses 1); `mask` `[B, T]` selects the counted positions (None: all).
    """

    def loss(
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        temperature: float = 1.0,
        reduction: Reduction = "mean",
        **options: float,
    ) -> torch.Tensor:
        log_q, log_p, keep = _log_probs(student_logits, teacher_logits, mask, temperature)
        return _reduce(per_position(log_q, log_p, **options), keep, reduction)

    loss.__name__ = loss.__qualname__ = per_position.__name__
    loss.__doc__ = per_position.__doc__
    return loss


@token_loss
def forward_kl(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """Forward KL(p || q) = Σ_v p (log p - log q): mode-covering, the supervised-KD loss; where
    q = 0 < p (a truncated vocabulary) log q is floored at `LOG_PROB_FLOOR`."""
    return _kl(log_p, log_q)


@token_loss
def reverse_kl(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """Reverse KL(q || p) = Σ_v q (log q - log p): mode-seeking; where p = 0 < q, log p is floored."""
    return _kl(log_q, log_p)


@token_loss
def jsd(log_q: torch.Tensor, log_p: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence, as TRL's `generalized_jsd_loss` and the GKD paper:
    with m = beta · p + (1 - beta) · q, JSD_beta = beta · KL(p || m) + (1 - beta) · KL(q || m), beta
    in (0, 1) (its endpoints are 0 here). No floor is needed: the value is at most log 2 per token.
    """
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1), got {beta!r}; use forward_kl (beta -> 0) or reverse_kl (beta -> 1)")
    # log m in log space: a -inf on one side is replaced by a value so low its exp is 0 in fp32,
    # which keeps logsumexp's backward finite where p = q = 0 (its softmax would be 0 / 0).
    very_low = -1e4
    log_m = torch.logsumexp(
        torch.stack(
            [
                torch.where(torch.isneginf(log_p), very_low, log_p) + math.log(beta),
                torch.where(torch.isneginf(log_q), very_low, log_q) + math.log1p(-beta),
            ]
        ),
        dim=0,
    )
    return beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)


@token_loss
def tvd(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """Total variation distance 0.5 · Σ_v |p - q| = 1 - `expected_acceptance`, in [0, 1] per token:
    minimising it maximises the acceptance rate directly (DistillSpec). This form is exactly 0 for
    identical inputs, where 1 - Σ min(p, q) would cancel; the gradients are the same."""
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


def expected_acceptance(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Mean over counted positions of Σ_v min(p, q): the acceptance rate alpha of sampling at
    `temperature` (0: the temperature-1 distributions, not greedy agreement). Arguments as the
    losses' (`token_loss`), less `reduction`; 0 when no position is counted."""
    log_q, log_p, keep = _log_probs(student_logits, teacher_logits, mask, temperature)
    return _reduce(torch.minimum(log_p.exp(), log_q.exp()).sum(-1), keep, "mean")


LOSSES: dict[str, Loss] = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "jsd": jsd, "tvd": tvd}


def get_loss(name: str) -> Loss:
    """Look a loss up by its config name; a ValueError names an unknown one and the valid ones."""
    try:
        return LOSSES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown loss {name!r}; valid losses: {', '.join(sorted(LOSSES))}") from None
