"""Speculative rejection sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2).

Notation of the papers: p is the target's distribution, q the drafter's, x a drafted token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specdecode.decoding.cache import cached_forward_features
from specdecode.decoding.sampling import Generator, Params, logits_to_probs, next_tokens, sample, uniform

if TYPE_CHECKING:
    from specdecode.decoding.cache import KVCache
    from specdecode.decoding.drafting import Drafting


def rejection_sample(
    draft_tokens: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: Generator = None,
    greedy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's drafts so that the output follows p exactly.

    Draft i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection n the
    next token is drawn from norm(max(0, p_n - q_n)); if all gamma drafts are accepted it is a
    bonus token drawn from p_gamma. Vectorised over the batch and the draft positions.

    Args:
        draft_tokens: `[B, gamma]` int64, the drafted tokens.
        q: `[B, gamma, V]` fp32, the distribution each draft was sampled from.
        p: `[B, gamma + 1, V]` fp32, the target's distribution at each draft position, plus one
            position past the last draft (for the bonus token).
        generator: RNG for the uniforms and the resample (or their draws made ahead: `DrawnAhead`);
            `None` uses torch's global RNG.
        greedy: p and q are one-hot (temperature 0): the resample is the residual's argmax, no noise.

    Returns `num_accepted` `[B]` int64 in [0, gamma] and `next_token` `[B]` int64 (the resampled or
    bonus token, which always follows the accepted drafts).
    """
    batch_size, gamma = draft_tokens.shape
    vocab_size = p.shape[-1]
    index = draft_tokens.unsqueeze(-1)
    p_x = p[:, :gamma].gather(-1, index).squeeze(-1)
    q_x = q.gather(-1, index).squeeze(-1)
    # q(x) > 0 for a token sampled from q; the floor only keeps stub inputs with q(x) = 0 finite
    # (p(x) / tiny then exceeds 1 and the draft is accepted, the limit of the ratio).
    accept_prob = (p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny)).clamp_max(1.0)
    accepted = uniform((batch_size, gamma), p.device, generator) < accept_prob
    # Drafts after the first rejection do not count, accepted or not.
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)

    # Padding q with a zero distribution at position gamma makes the bonus token the same formula:
    # max(0, p_gamma - 0) = p_gamma.
    q_padded = F.pad(q, (0, 0, 0, 1))
    at_n = num_accepted.view(batch_size, 1, 1).expand(batch_size, 1, vocab_size)
    p_n = p.gather(1, at_n).squeeze(1)
    residual = (p_n - q_padded.gather(1, at_n).squeeze(1)).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # A rejection implies p(x) < q(x), so p > q somewhere and the residual has mass; it can only be
    # all zero through rounding when p and q agree to the last bit, where p itself is correct.
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), p_n)
    next_token = residual.argmax(dim=-1) if greedy else sample(residual, generator)
    return num_accepted, next_token


def greedy_accept(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample(greedy=True)` without building one-hot p and q (~1 ms a step at a 49k vocabulary):
    drafts `[B, gamma]` are accepted while they equal the target's argmax `[B, gamma + 1]`, and the next
    token is its argmax at the first mismatch or past the last draft → `num_accepted` `[B]`, `next_token` `[B]`."""
    gamma = draft_tokens.shape[1]
    num_accepted = (draft_tokens == target_argmax[:, :gamma]).long().cumprod(dim=1).sum(dim=1)
    return num_accepted, target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)


def verify_drafts(
    target: PreTrainedModel,
    cache: KVCache,
    drafting: Drafting,
    pending: torch.Tensor,
    draft: torch.Tensor,
    q: torch.Tensor | None,
    start: torch.Tensor,
    params: Params,
    generator: Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One target pass over each row's pending token `[B, 1]` and its gamma drafts `[B, gamma]` (at
    positions `start[b]` on; the drafting strategy observes the pass's features), then accept or
    resample (`greedy_accept` when `q` is None); rows outside `drafting.drafting_rows` take the
    target's token after their pending one. The loops' shared step.

    Returns `num_accepted` `[B]`, the next token `[B]`, and the new tokens `[B, gamma + 1]` (the drafts
    with the next token at `num_accepted`), of which each row commits `num_accepted + 1`.
    """
    features = drafting.feature_layers
    logits, hidden = cached_forward_features(target, cache, torch.cat([pending, draft], dim=1), feature_layers=features)
    drafting.observe(hidden, start)
    num_accepted, next_token = (
        greedy_accept(draft, logits.argmax(dim=-1))
        if q is None
        else rejection_sample(draft, q, logits_to_probs(logits, params), generator)
    )
    drafted = drafting.drafting_rows
    if drafted is not None:
        # a row that drafted nothing takes the target's own token after its pending one, as a
        # target-only step would (placeholder drafts are never judged: greedy or sampled, it is exact)
        num_accepted = torch.where(drafted, num_accepted, 0)
        next_token = torch.where(drafted, next_token, next_tokens(logits[:, 0], params, generator))
    new_tokens = torch.cat([draft, draft[:, :1]], dim=1).scatter(1, num_accepted.unsqueeze(1), next_token.unsqueeze(1))
    return num_accepted, next_token, new_tokens
