"""How each kind of drafter proposes gamma tokens inside every decoder's speculative loop. Each
strategy implements `Drafting` (as transformers' `CandidateGenerator`s do) on the KV cache its
decoder gives it, applying prompt lookup to its drafts as they are drawn (`lookup.py`).

* `SliceDrafting`: a plain causal LM whose cache holds all committed tokens but the last two, which
  each step re-feeds (one extra token costs almost nothing and spares a path for all-accepted steps).
* `FeatureDrafting`: a `FeatureDrafter` reading the target's hidden states from the verify pass,
  kept per row `[B, S_cap, n·H]`. Each step reads one fixed-width window over the positions whose
  true features are new, which yields the first draft; drafts 2..gamma feed back the predicted feature.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from specdecode.decoding.cache import KVCache, cached_call, cached_forward
from specdecode.decoding.lookup import DraftLookup, override_q
from specdecode.decoding.rows import last_tokens
from specdecode.decoding.sampling import Generator, Params, logits_to_probs, sample
from specdecode.models.draft_vocab import DraftVocabHead
from specdecode.models.feature_drafter import FeatureDrafter, feed_back

# Target-only steps a feature drafter lets pass before reading the positions it skipped.
CATCH_UP = 8


class Drafting(ABC):
    """What the speculative loop asks of a drafting strategy, and the state every one keeps; shapes
    for a batch of B rows in token buffers of S_cap slots."""

    # which target hidden states the strategy reads (the verify returns them `[B, W, n·H]`); None: none
    feature_layers: tuple[int, ...] | None = None
    # how many ids a sampled draft is drawn over where a draft vocabulary has K; None: the full vocabulary
    draw_width: int | None = None
    # the truncated head whose K ids the drafts are drawn over (`draw_width` = K); None: none
    draft_head: DraftVocabHead | None = None
    # which rows drafted this step `[B]` bool (the others' placeholders are never judged); None: every row
    drafting_rows: torch.Tensor | None = None
    # a mixed batch's rows per drafter, known on the host (`AdaptiveGamma.seconds`); None: one drafter
    groups: list[int] | None = None

    def __init__(
        self,
        drafter: PreTrainedModel | FeatureDrafter,
        cache: KVCache,
        lookup: DraftLookup | None = None,
        gamma: int = 0,
    ) -> None:
        """`gamma`: the drafts per step where it is fixed (a static decoder's steps then all keep one shape)."""
        self.drafter = drafter
        # the drafter's KV cache, of its decoder's kind (ragged or static)
        self.cache = cache
        self.lookup = lookup
        # drafts taken from prompt lookup so far, a 0-d tensor counted on the device (never synced)
        self.looked_up = cache.buffer("drafting.looked_up", (), torch.long)
        # which of the last `propose`'s drafts prompt lookup filled, `[B, gamma]` bool; None without lookup
        self.last_looked_up: torch.Tensor | None = None
        # target-only steps since the last `propose`, and its gamma: how far the drafter is behind the rows
        self.behind = 0
        self.last_gamma = gamma

    @abstractmethod
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, longest: int, features: torch.Tensor | None) -> None:
        """Take in the right-padded prompts `tokens[:, :longest]` (`lengths` `[B]`) and, when
        `feature_layers` is set, the target's prompt features `[B, longest, n·H]`."""

    def propose(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        max_length: int,
        gamma: int,
        params: Params,
        generator: Generator,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft `gamma` tokens after each row's `lengths[b]` committed `tokens` `[B, S_cap]`: the
        drafts `[B, gamma]` and their distributions `[B, gamma, V]` (None when greedy)."""
        drafts = _Drafts(tokens, lengths, self.lookup, self.looked_up, params, generator, self.draft_head)
        self._draft(drafts, max_length, gamma)
        draft, q, self.last_looked_up = drafts.result()
        self.behind, self.last_gamma = 0, gamma
        return draft, q

    def skip(self, tokens: torch.Tensor, lengths: torch.Tensor, max_length: int) -> None:
        """The loop took a target-only step: every row committed one token the drafter has not read;
        the next `propose` catches up on it."""
        self.behind += 1

    def snapshot(self) -> Callable[[], None]:
        """A function that puts the strategy's progress back as it is now (timing repeats a step)."""
        behind, last_gamma = self.behind, self.last_gamma

        def restore() -> None:
            self.behind, self.last_gamma = behind, last_gamma

        return restore

    @abstractmethod
    def _draft(self, drafts: _Drafts, max_length: int, gamma: int) -> None:
        """Draw `gamma` drafts into `drafts` (`_Drafts.draw`) after each row's committed tokens."""

    def observe(self, features: torch.Tensor | None, start: torch.Tensor) -> None:
        """The verify pass's target features `[B, W, n·H]` of positions `start[b] + w` (None when
        `feature_layers` is None)."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` `[B']` of the batch (finished rows leave), in that order."""
        self.cache.select_rows(rows)


class SliceDrafting(Drafting):
    """A plain causal-LM drafter (see the module docstring); drafts are drawn over the full
    vocabulary (a draft-vocabulary head still returns full logits)."""

    drafter: PreTrainedModel

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, longest: int, features: torch.Tensor | None) -> None:
        """Cache the right-padded prompts `tokens[:, :longest]` (the first token is not yet committed)."""
        cached_forward(self.drafter, self.cache, tokens[:, :longest], logits_to_keep=1)
        self.cache.set_lengths(lengths.clone(), longest)

    def _draft(self, drafts: _Drafts, max_length: int, gamma: int) -> None:
        fed = 2 + self.behind  # and each target-only step's token since the last propose
        self.cache.set_lengths(drafts.lengths - fed, max_length - fed)
        drafter_input = last_tokens(drafts.context, drafts.lengths, fed)
        for _ in range(gamma):
            logits = cached_forward(self.drafter, self.cache, drafter_input, logits_to_keep=1)[:, -1]
            drafter_input = drafts.draw(logits).unsqueeze(1)


class FeatureDrafting(Drafting):
    """A `FeatureDrafter` fed the target's hidden states (see the module docstring)."""

    drafter: FeatureDrafter

    def __init__(
        self, drafter: FeatureDrafter, cache: KVCache, lookup: DraftLookup | None = None, gamma: int = 0
    ) -> None:
        super().__init__(drafter, cache, lookup, gamma)
        self.feature_layers = drafter.feature_layers
        self.capacity = cache.capacity
        shape = (cache.batch_size, cache.capacity, drafter.feature_width)
        self.features = cache.buffer("drafting.features", shape, drafter.dtype)
        # Per row: drafter positions [0, start) hold true-feature entries; and its host-side bound.
        self.start = torch.zeros(cache.batch_size, dtype=torch.long, device=drafter.device)
        self.start_bound = 0
        head = drafter.get_output_embeddings()
        # q is computed and sampled over a truncated head's K ids, spread to the full vocabulary once
        # per step (over 49k ids that costs more than the drafter's step; the other ids' q is 0 exactly)
        self.draft_head = head if isinstance(head, DraftVocabHead) else None
        self.draw_width = None if self.draft_head is None else self.draft_head.weight.shape[0]

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, longest: int, features: torch.Tensor | None) -> None:
        """Keep the target's prompt features `[B, longest, n·H]` and read all but each row's last
        (whose token p + 1 is not yet drawn), so the first window is as wide as every later one."""
        assert features is not None
        self.features[:, :longest] = features.to(self.features.dtype)
        # at least one position wide, so the drafter's cache is allocated here even for one-token prompts
        self._read(tokens, lengths - 1, longest - 1, max(longest - 1, 1))

    def _draft(self, drafts: _Drafts, max_length: int, gamma: int) -> None:
        # 1. one window over the positions whose true features are new, [start, lengths - 1): at most
        # the last gamma + 1 and one per target step since; at least gamma + 1, so a fixed gamma keeps one width
        width = max(gamma, self.last_gamma + self.behind) + 1
        feature = self._read(drafts.context, drafts.lengths - 1, max_length - 1, width)
        # 2. gamma drafts, each fed back with the feature it was predicted from
        head = self.draft_head
        for i in range(gamma):
            # logits over the K draft ids of a truncated head (K = V without one)
            logits = self.drafter.logits(feature[:, -1]) if head is None else head.draft_logits(feature[:, -1])
            draft = drafts.draw(logits).unsqueeze(1)
            if i + 1 < gamma:
                fed = feed_back(feature, self.features.shape[-1])
                feature = cached_call(self.cache, 1, self.drafter.dtype, lambda **kw: self.drafter(fed, draft, **kw))

    def _read(self, tokens: torch.Tensor, upto: torch.Tensor, bound: int, width: int) -> torch.Tensor:
        """Run the drafter over each row's positions [start, upto) in one window of `width` (the
        longest such span at most; `bound` = max(upto)) and move `start` to `upto`; the feature
        predicted at each row's last position, `[B, 1, H]`."""
        count = upto - self.start  # [B], 1..width (0 for a one-token prompt's row in the prefill)
        self.cache.set_lengths(self.start, self.start_bound)
        index = (self.start.unsqueeze(1) + torch.arange(width, device=tokens.device)).clamp_max(self.capacity - 2)
        window_features = self.features.gather(1, index.unsqueeze(-1).expand(-1, -1, self.features.shape[-1]))
        hidden = cached_call(
            self.cache,
            width,
            self.drafter.dtype,
            lambda **kw: self.drafter(window_features, tokens.gather(1, index + 1), **kw),
        )
        feature = hidden[torch.arange(tokens.shape[0], device=tokens.device), count - 1].unsqueeze(1)
        self.cache.set_lengths(upto, bound)
        self.start, self.start_bound = upto, bound
        return feature

    def skip(self, tokens: torch.Tensor, lengths: torch.Tensor, max_length: int) -> None:
        """As `Drafting.skip`; every `CATCH_UP` target-only steps the drafter reads the positions it
        skipped but the last, which keeps its window within gamma + `CATCH_UP` + 1."""
        super().skip(tokens, lengths, max_length)
        if self.behind >= CATCH_UP:
            self._read(tokens, lengths - 2, max_length - 2, self.last_gamma + self.behind + 1)
            self.last_gamma, self.behind = 0, 1

    def observe(self, features: torch.Tensor | None, start: torch.Tensor) -> None:
        """Store the verify pass's features `[B, W, n·H]` at positions `start[b] + w`."""
        assert features is not None
        width = features.shape[1]
        index = (start.unsqueeze(1) + torch.arange(width, device=start.device)).clamp_max(self.capacity - 1)
        # an indexed assignment: a bf16 `scatter_` copies the whole buffer on the CPU
        rows = torch.arange(features.shape[0], device=start.device).unsqueeze(1)
        self.features[rows, index] = features.to(self.features.dtype)

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self.features = self.features.index_select(0, rows)
        self.start = self.start.index_select(0, rows)

    def snapshot(self) -> Callable[[], None]:
        restore_base, start, bound = super().snapshot(), self.start.clone(), self.start_bound

        def restore() -> None:
            restore_base()
            self.start, self.start_bound = start.clone(), bound

        return restore


class _Drafts:
    """The drafts of one step as they are drawn (`params`, `generator`; over a truncated `head`'s
    ids where given), with prompt lookup applied (`lookup.py`): a row may take a looked-up token
    instead of its drawn one, and its q is then one-hot there."""

    def __init__(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        lookup: DraftLookup | None,
        looked_up: torch.Tensor,
        params: Params,
        generator: Generator,
        head: DraftVocabHead | None,
    ) -> None:
        self.lookup, self.params, self.generator, self.head = lookup, params, generator, head
        # the drafting's running count of looked-up drafts (0-d, added to in place: never synced)
        self.looked_up = looked_up
        # committed tokens, then this step's drafts (a copy: the batch's own buffer stays committed-only)
        self.context = tokens.clone() if lookup is not None else tokens
        self.lengths = lengths
        self.drafts: list[torch.Tensor] = []
        self.q: list[torch.Tensor] = []
        self.used: list[torch.Tensor] = []

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """Draw the next draft `[B]` from the drafter's `logits` `[B, K]` (greedy: the argmax, no q),
        apply lookup; return the draft proposed."""
        if self.params.greedy:
            index = logits.argmax(dim=-1)
        else:
            self.q.append(logits_to_probs(logits, self.params))
            index = sample(self.q[-1], self.generator)
        draft = index if self.head is None else self.head.draft_ids[index]
        if self.lookup is not None:
            at = self.lengths + len(self.drafts)
            draft, used = self.lookup.choose(logits, draft, self.context, at)
            self.context.scatter_(1, at.unsqueeze(1), draft.unsqueeze(1))
            self.used.append(used)
        self.drafts.append(draft)
        return draft

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Drafts `[B, gamma]`, their distributions `[B, gamma, V]` (None when greedy) and which ones
        lookup filled `[B, gamma]` bool (None without lookup); counts the looked-up ones."""
        drafts = torch.stack(self.drafts, dim=1)
        used = torch.stack(self.used, dim=1) if self.used else None
        if used is not None:
            self.looked_up += used.sum()
        if not self.q:
            return drafts, None, used
        q = torch.stack(self.q, dim=1)
        if self.head is not None:
            q = self.head.spread(q)
        return drafts, q if used is None else override_q(q, drafts, used), used


def drafting_for(
    drafter: PreTrainedModel | FeatureDrafter, cache: KVCache, lookup: DraftLookup | None = None, gamma: int = 0
) -> SliceDrafting | FeatureDrafting:
    """The drafting strategy of `drafter`'s kind, driving it on `cache` (the drafter's, of the core's kind)."""
    if isinstance(drafter, FeatureDrafter):
        return FeatureDrafting(drafter, cache, lookup, gamma)
    return SliceDrafting(drafter, cache, lookup, gamma)
