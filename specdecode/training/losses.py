"""Token-level distillation losses between a drafter q (student) and a target p (teacher).

DistillSpec (Zhou et al. 2023) trains the drafter to match the target token by token; which
divergence works best depends on the task and decoding strategy, so all the usual ones are here as
pure functions over logits with one calling convention::

    loss = fn(student_logits, teacher_logits, mask, temperature=..., reduction="mean" | "sum")

Notation follows the speculative-decoding papers: p is the target (teacher), q the drafter
(student). Logits are `[B, T, V]` (any leading shape works), `mask` is `[B, T]`, bool or 0/1.

Normalisation. A per-micro-batch mean weights the tokens of a short micro-batch more than those of
a long one. To normalise per token across gradient-accumulation steps and processes, call with
`reduction="sum"`, add up the sums, and divide by the global token count (`token_count` of every
micro-batch, summed and all-reduced), as torchtune's `scale_grads` does.

Truncated vocabularies. A drafter with a smaller vocabulary emits `-inf` logits outside it, so
q = 0 there. Every loss here stays finite, with finite gradients, in that case: log-probabilities
come from `log_softmax`, and 0 · log 0 is taken as 0 through `torch.where` with the `-inf` replaced
*before* the product (a bare `torch.where` still back-propagates 0 · inf = NaN through the branch
it did not pick).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

Reduction = Literal["mean", "sum"]
Loss = Callable[..., torch.Tensor]

# Forward KL(p || q) is infinite where p > 0 = q (a token the truncated drafter cannot emit). Such
# a log q = -inf is replaced by log(1e-8), so the token adds p · (log p - log 1e-8), a finite
# penalty that does not depend on the drafter and so changes the reported value, never the
# gradient. Finite log-probabilities are left alone, even below the floor: a plain clamp would
# zero the gradient of every token the drafter currently rates below 1e-8, the tokens it most needs
# to learn.
LOG_PROB_FLOOR = math.log(1e-8)


def _temperature(temperature: float) -> float:
    """The temperature the loss divides logits by: 0 (greedy decoding) maps to 1.

    Greedy decoding has no distribution to match; distilling the temperature-1 distributions keeps
    the argmax (what greedy acceptance depends on) while still giving a smooth loss.
    """
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if temperature < 0 or math.isnan(temperature):
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    return 1.0 if temperature == 0 else float(temperature)


def _log_probs(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check the shapes (arguments as `forward_kl`'s) and return `(log_q, log_p, keep)`: fp32
    log-probabilities `[B, T, V]` and the boolean position mask `[B, T]`."""
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


def _kl(log_a: torch.Tensor, log_b: torch.Tensor, *, floor: float = LOG_PROB_FLOOR) -> torch.Tensor:
    """KL(a || b) = Σ_v a (log a - log b) per position: `[B, T, V]` log-probs → `[B, T]`.

    0 · log 0 = 0 where a = 0; where a > 0 = b, log b = -inf is replaced by `floor`.
    """
    a = log_a.exp()
    support = a > 0
    safe_log_a = torch.where(support, log_a, 0.0)
    safe_log_b = torch.where(torch.isneginf(log_b), floor, log_b)
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
    """Number of positions a `reduction="sum"` loss added up (`mask` `[B, T]`, or None for every
    position of `logits` `[B, T, V]`): the divisor for per-token means. A 0-d int64 tensor on the
    logits' device, so it can be all-reduced without a host sync."""
    if mask is None:
        return torch.tensor(math.prod(logits.shape[:-1]), device=logits.device)
    return mask.to(torch.bool).sum()


def forward_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Forward KL(p || q) = Σ_v p (log p - log q): mode-covering, the supervised-KD loss.

    Where the target puts mass on a token the drafter cannot emit (q = 0, a truncated vocabulary)
    the true value is infinite; log q is floored at `LOG_PROB_FLOOR` there (see its comment).

    Args:
        student_logits: `[B, T, V]` drafter logits (q); `-inf` entries allowed.
        teacher_logits: `[B, T, V]` target logits (p); `-inf` entries allowed.
        mask: `[B, T]` bool or 0/1 selecting the positions that count; None counts all.
        temperature: both logits are divided by it; 0 (greedy decoding) uses 1.
        reduction: "mean" per counted token, or "sum" to divide by a global count yourself.

    Returns 0-d fp32 tensor.
    """
    log_q, log_p, keep = _log_probs(student_logits, teacher_logits, mask, temperature)
    return _reduce(_kl(log_p, log_q), keep, reduction)


def reverse_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Reverse KL(q || p) = Σ_v q (log q - log p): mode-seeking.

    Tokens the drafter cannot emit (q = 0) add nothing. Where the drafter puts mass on a token the
    target rules out (p = 0, a target `-inf` logit), log p is floored at `LOG_PROB_FLOOR`.

    Arguments and result as `forward_kl`'s, the signature every loss shares.
    """
    log_q, log_p, keep = _log_probs(student_logits, teacher_logits, mask, temperature)
    return _reduce(_kl(log_q, log_p), keep, reduction)


def jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence, as TRL's `generalized_jsd_loss` and the GKD paper.

    With the mixture m = beta · p + (1 - beta) · q::

        JSD_beta(p, q) = beta · KL(p || m) + (1 - beta) · KL(q || m)

    beta = 0.5 is the symmetric JSD. The endpoints themselves give 0 (m equals one side and that
    side's weight vanishes), but rescaled the limits are the two KLs:

    - beta → 0: JSD_beta / beta → KL(p || q), the forward KL (`forward_kl`);
    - beta → 1: JSD_beta / (1 - beta) → KL(q || p), the reverse KL (`reverse_kl`).

    So beta must lie strictly inside (0, 1); use `forward_kl` / `reverse_kl` for the endpoints
    (TRL special-cases beta 0 and 1 to those KLs instead). No floor is needed: m >= beta · p and
    m >= (1 - beta) · q, so the value is at most the binary entropy H(beta) <= log 2 per token,
    even with `-inf` logits on either side.

    `beta` is the mixture weight of the target p, in (0, 1); the other arguments and the result
    are as `forward_kl`'s, the signature every loss shares.
    """
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1), got {beta!r}; use forward_kl (beta -> 0) or reverse_kl (beta -> 1)")
    log_q, log_p, keep = _log_probs(student_logits, teacher_logits, mask, temperature)
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
    per_position = beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)
    return _reduce(per_position, keep, reduction)


def _acceptance_per_position(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """Σ_v min(p, q): `[B, T, V]` log-probs → `[B, T]`."""
    return torch.minimum(log_p.exp(), log_q.exp()).sum(-1)


def tvd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Total variation distance 0.5 · Σ_v |p - q| = 1 - Σ_v min(p, q).

    Speculative sampling accepts a drafted token with probability Σ_v min(p, q) (Leviathan et al.
    2023), so TVD is exactly 1 - `expected_acceptance`: minimising it maximises the acceptance
    rate directly (DistillSpec's motivation). It is computed as 0.5 · Σ|p - q| because that form
    is exactly 0 for identical inputs and keeps precision when the TVD is tiny, where
    1 - Σ min(p, q) cancels; both forms have the same gradient with respect to the logits.

    Arguments as `forward_kl`'s, the signature every loss shares; a 0-d fp32 tensor in [0, 1] per token.
    """
    log_q, log_p, keep = _log_probs(student_logits, teacher_logits, mask, temperature)
    per_position = 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    return _reduce(per_position, keep, reduction)


def expected_acceptance(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Mean over counted positions of Σ_v min(p, q): the speculative-sampling acceptance rate.

    This is the per-token acceptance probability alpha of a drafted token under sampling at
    `temperature`. At temperature 0 it uses the temperature-1 distributions (as the losses do);
    greedy acceptance itself is 1[argmax p = argmax q], which this does not compute.

    Arguments as `forward_kl`'s, less `reduction`; a 0-d fp32 tensor in [0, 1], 0 when no position
    is counted.
    """
    log_q, log_p, keep = _log_probs(student_logits, teacher_logits, mask, temperature)
    return _reduce(_acceptance_per_position(log_q, log_p), keep, "mean")


LOSSES: dict[str, Loss] = {
    "forward_kl": forward_kl,
    "reverse_kl": reverse_kl,
    "jsd": jsd,
    "tvd": tvd,
}


def get_loss(name: str) -> Loss:
    """Look a loss up by its config name; a ValueError names an unknown one and the valid ones."""
    try:
        return LOSSES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown loss {name!r}; valid losses: {', '.join(sorted(LOSSES))}") from None
