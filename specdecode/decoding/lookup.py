"""Prompt lookup beside a trained drafter (Saxena 2023): where the row's last n tokens occurred
earlier, a row whose drafter is unsure drafts the token that followed. The choice depends only on
the state before the draw, so q is one-hot there (`override_q`) and rejection sampling stays exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from specdecode.core.config import is_int, is_number, require


class DraftLookup(Protocol):
    """What a drafting strategy asks of prompt lookup (`PromptLookup.choose`)."""

    def choose(
        self, logits: torch.Tensor, drafts: torch.Tensor, context: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class PromptLookup:
    """Where and how a row drafts a looked-up token: `speculative_generate(prompt_lookup=...)` and
    the apps' `prompt_lookup` block. Suffixes of `max_ngram` down to `min_ngram` tokens are tried;
    a match overrides a drafter whose top probability is below `max_confidence`; above
    `max_temperature` the drafter drafts alone (a looked-up token is accepted with probability p(x))."""

    enabled: bool = True
    max_ngram: int = 4
    min_ngram: int = 2
    max_confidence: float = 0.7
    max_temperature: float = 0.7

    def __post_init__(self) -> None:
        require(isinstance(self.enabled, bool), "prompt_lookup.enabled", self.enabled, "true or false")
        if not is_int(self.min_ngram) or self.min_ngram < 1:
            raise ValueError(f"prompt lookup min_ngram must be an int >= 1, got {self.min_ngram!r}")
        if not is_int(self.max_ngram) or self.max_ngram < self.min_ngram:
            raise ValueError(
                f"prompt lookup max_ngram must be an int >= min_ngram={self.min_ngram}, got {self.max_ngram!r}"
            )
        if not is_number(self.max_confidence) or not 0.0 <= self.max_confidence <= 1.0:
            raise ValueError(f"prompt lookup max_confidence must be in [0, 1], got {self.max_confidence!r}")
        if not is_number(self.max_temperature) or not 0.0 <= self.max_temperature < math.inf:
            raise ValueError(
                f"prompt lookup max_temperature must be a finite number >= 0, got {self.max_temperature!r}"
            )

    def applies(self, temperature: float) -> bool:
        """Whether decoding at `temperature` uses the lookup."""
        return self.enabled and temperature <= self.max_temperature

    def choose(
        self, logits: torch.Tensor, drafts: torch.Tensor, context: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafts `[B]` after lookup, and which rows took the looked-up token `[B]` bool, from
        the drafter's `logits` `[B, K]` and `drafts` `[B]` after `context[b, :lengths[b]]` `[B, S]`."""
        found, looked_up = lookup(context, lengths, self.max_ngram, self.min_ngram)
        unsure = logits.float().softmax(dim=-1).amax(dim=-1) < self.max_confidence
        use = found & unsure
        return torch.where(use, looked_up, drafts), use


# What `speculative_generate` uses unless told otherwise.
DEFAULT_LOOKUP = PromptLookup()


class ActiveRowsLookup:
    """A `PromptLookup` only the active rows use (a masked row's drafts are never counted as looked up)."""

    def __init__(self, lookup: PromptLookup) -> None:
        self.lookup = lookup
        self.active: torch.Tensor | None = None

    def choose(
        self, logits: torch.Tensor, drafts: torch.Tensor, context: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.active is None:
            raise RuntimeError("ActiveRowsLookup.choose() needs .active, the rows' mask [B], set before each round")
        chosen, used = self.lookup.choose(logits, drafts, context, lengths)
        used = used & self.active
        return torch.where(used, chosen, drafts), used


def lookup(
    context: torch.Tensor, lengths: torch.Tensor, max_ngram: int, min_ngram: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of `context` `[B, S]` (`lengths` `[B]` valid), the token that followed the most
    recent earlier occurrence of its last n tokens, longest n first: `found` `[B]` bool, `token` `[B]`."""
    batch, capacity = context.shape
    found = torch.zeros(batch, dtype=torch.bool, device=context.device)
    token = torch.zeros(batch, dtype=context.dtype, device=context.device)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= capacity:
            continue
        suffix = context.gather(1, (lengths.unsqueeze(1) - n + torch.arange(n, device=context.device)).clamp_min(0))
        starts = torch.arange(capacity - n + 1, device=context.device)
        matches = (context.unfold(1, n, 1) == suffix.unsqueeze(1)).all(dim=-1)
        matches &= starts + n < lengths.unsqueeze(1)
        # the most recent match: the largest matching start (argmax of start + 1 where matched, else 0)
        last = (matches * (starts + 1)).argmax(dim=1)
        hit = matches.any(dim=1) & ~found
        token = torch.where(hit, context.gather(1, (last + n).clamp_max(capacity - 1).unsqueeze(1)).squeeze(1), token)
        found |= hit
    return found, token


def override_q(q: torch.Tensor, drafts: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary draft distributions `[B, gamma, V]` with the looked-up steps (`used`
    `[B, gamma]`) one-hot at their drafts `[B, gamma]`: what those drafts were drawn from."""
    return torch.where(used.unsqueeze(-1), F.one_hot(drafts, q.shape[-1]).to(q.dtype), q)


def lookup_logits(
    logits: torch.Tensor, tokens: torch.Tensor, attention: torch.Tensor, columns: torch.Tensor, settings: PromptLookup
) -> torch.Tensor:
    """Teacher forcing with lookup: a drafter's logits `[B, C, V]` at `columns` `[C]` of the
    left-padded `tokens` / `attention` `[B, S]`, one-hot (0 / -inf) wherever decoding would draft
    a looked-up token, so scoring them against the target gives the acceptance decoding would see."""
    batch, width = tokens.shape
    # Padding becomes distinct negative ids, so no window holding padding matches another window.
    context = torch.where(attention.bool(), tokens, -1 - torch.arange(width, device=tokens.device))
    # one lookup per (row, column): the row's tokens up to and including that column
    found, token = lookup(
        context.repeat_interleave(len(columns), dim=0),
        (columns + 1).repeat(batch),
        settings.max_ngram,
        settings.min_ngram,
    )
    found, token = found.view(batch, -1), token.view(batch, -1)
    use = found & (logits.float().softmax(dim=-1).amax(dim=-1) < settings.max_confidence)
    one_hot = torch.full_like(logits, float("-inf")).scatter_(-1, token.clamp_min(0).unsqueeze(-1), 0.0)
    return torch.where(use.unsqueeze(-1), one_hot, logits)
