"""One batch, many drafters: each row drafts with the drafter routed to it, and one target pass per
step verifies every row (`speculative_generate(drafter={name: drafter}, assign=[name, ...])`).
A row routed to no drafter (None) gets placeholder drafts the verify never judges.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from specdecode.decoding.cache import RaggedKVCache
from specdecode.decoding.drafting import Drafting, _Drafts, drafting_for
from specdecode.decoding.lookup import DraftLookup
from specdecode.decoding.sampling import Generator, Params
from specdecode.decoding.stats import GenerationResult
from specdecode.decoding.validation import validate_models
from specdecode.models.feature_drafter import FeatureDrafter, target_features

Drafter = PreTrainedModel | FeatureDrafter


@dataclass(frozen=True)
class RowDrafters:
    """Which drafter drafts each row of a batch: drafter k is `names[k]` / `models[k]` (only those
    some row uses), and `owners[i]` is prompt i's k, None where the target decodes it alone."""

    names: tuple[str, ...]
    models: tuple[Drafter, ...]
    owners: tuple[int | None, ...]

    def named(self, result: GenerationResult) -> GenerationResult:
        """`result` with each record (`record=True`) naming its row's drafter; a row without one keeps
        `drafter` None and no drafts (its placeholders were never judged: its steps are the target's)."""
        if result.record is None:
            return result
        records = []
        for record, owner in zip(result.record, self.owners):
            if owner is None:
                steps = [replace(step, drafted=[], looked_up=[]) for step in record.steps]
                records.append(replace(record, steps=steps))
            else:
                records.append(replace(record, drafter=self.names[owner]))
        return replace(result, record=records)


def row_drafters(
    target: PreTrainedModel, drafters: object, assign: object, prompt_lookup: object = None
) -> RowDrafters:
    """`drafters` by name and each prompt's name in `assign` (None: the target alone), each drafter
    checked against `target` (`speculative_generate` checks the count against the prompts)."""
    if not isinstance(drafters, Mapping) or not drafters:
        raise TypeError(f"drafter must be one drafter or a non-empty mapping of names to drafters, got {drafters!r}")
    if isinstance(assign, (str, bytes)) or not isinstance(assign, Sequence):
        raise TypeError(
            f"with a mapping of drafters, assign must list each prompt's drafter name (or None), got {assign!r}"
        )
    unknown = next((name for name in assign if name is not None and name not in drafters), None)
    if unknown is not None:
        raise ValueError(f"assign names drafter {unknown!r}, which drafter lacks (it has {sorted(drafters)})")
    for name, model in drafters.items():
        try:
            validate_models(target, model, prompt_lookup)
        except ValueError as error:
            raise ValueError(f"drafter {name!r}: {error}") from None
    used = [name for name in drafters if name in set(assign)]
    index = {name: k for k, name in enumerate(used)}
    owners = tuple(None if name is None else index[name] for name in assign)
    return RowDrafters(tuple(used), tuple(drafters[name] for name in used), owners)


def union_layers(layer_sets: Sequence[tuple[int, ...]], num_layers: int) -> tuple[int, ...]:
    """The raw hidden states `layer_sets` read together, as one pass's `feature_layers` (-1 as
    `num_layers`, sorted; no trailing -1, so `target_features` returns them raw)."""
    return tuple(sorted({num_layers if i == -1 else i for layers in layer_sets for i in layers}))


class MixedDrafting(Drafting):
    """One sub-strategy per drafter, each drafting its own rows with a cache sized for them:
    `owners[b]` is row b's index in `subs`, None where the target decodes it alone."""

    def __init__(self, target: PreTrainedModel, subs: Sequence[Drafting], owners: Sequence[int | None]) -> None:
        # No `Drafting.__init__`: the subs own the drafters, their caches and lookup counters.
        self.subs = list(subs)
        self.owners = list(owners)
        self.last_looked_up = None
        self.device = target.device
        readers = [sub.feature_layers for sub in self.subs if sub.feature_layers is not None]
        self.shared_layers = len(set(readers)) <= 1
        text = target.config.get_text_config()
        self.num_layers, self.hidden_size = text.num_hidden_layers, text.hidden_size
        if readers:
            self.feature_layers = readers[0] if self.shared_layers else union_layers(readers, self.num_layers)
        self.target = target  # `target_features` reads its final norm for a sub's inner layers
        self._layout()

    def _layout(self) -> None:
        """Each sub's rows of the batch `[B_k]` (subs with none left skipped) and `drafting_rows`."""
        self.parts: list[tuple[Drafting, torch.Tensor]] = []
        for k, sub in enumerate(self.subs):
            rows = [b for b, owner in enumerate(self.owners) if owner == k]
            if rows:
                self.parts.append((sub, torch.tensor(rows, dtype=torch.long, device=self.device)))
        drafting = [owner is not None for owner in self.owners]
        self.drafting_rows = None if all(drafting) else torch.tensor(drafting, device=self.device)
        self.groups = [self.owners.count(k) for k in range(len(self.subs))]

    @property
    def looked_up(self) -> torch.Tensor:  # type: ignore[override]  # the subs' counts, summed (never synced)
        counts = [sub.looked_up for sub in self.subs]
        return torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.long, device=self.device)

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, longest: int, features: torch.Tensor | None) -> None:
        """Each sub takes its rows' prompts `tokens[rows, :longest]` and features `[B_k, longest, n·H]`."""
        for sub, rows in self.parts:
            sub_tokens, sub_lengths = tokens.index_select(0, rows), lengths.index_select(0, rows)
            sub.prefill(sub_tokens, sub_lengths, longest, self._features(sub, rows, features))

    def propose(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        max_length: int,
        gamma: int,
        params: Params,
        generator: Generator,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each sub's drafts `[B, gamma]` and q `[B, gamma, V]` for its rows, in batch order (q None
        when greedy or no row drafts); a row without a drafter holds placeholders (token 0, q 0)."""
        batch = lengths.shape[0]
        drafts = torch.zeros(batch, gamma, dtype=torch.long, device=lengths.device)
        q: torch.Tensor | None = None
        looked_up: torch.Tensor | None = None
        for sub, rows in self.parts:
            sub_drafts, sub_q = sub.propose(
                tokens.index_select(0, rows), lengths.index_select(0, rows), max_length, gamma, params, generator
            )
            drafts.index_copy_(0, rows, sub_drafts)
            if sub_q is not None:
                q = sub_q.new_zeros(batch, gamma, sub_q.shape[-1]) if q is None else q
                q.index_copy_(0, rows, sub_q)
            if sub.last_looked_up is not None:
                looked_up = torch.zeros_like(drafts, dtype=torch.bool) if looked_up is None else looked_up
                looked_up.index_copy_(0, rows, sub.last_looked_up)
        self.last_looked_up = looked_up
        return drafts, q

    def skip(self, tokens: torch.Tensor, lengths: torch.Tensor, max_length: int) -> None:
        """A target-only step: every sub falls one step behind, on its own rows."""
        for sub, rows in self.parts:
            sub.skip(tokens.index_select(0, rows), lengths.index_select(0, rows), max_length)

    def _draft(self, drafts: _Drafts, max_length: int, gamma: int) -> None:
        """Never called: `propose` hands each sub its own rows."""
        raise TypeError("MixedDrafting drafts through its subs (propose)")

    def observe(self, features: torch.Tensor | None, start: torch.Tensor) -> None:
        """Each sub that reads features gets its rows' `[B_k, W, n_k·H]` of positions `start[rows] + w`."""
        for sub, rows in self.parts:
            sub_features = self._features(sub, rows, features)
            if sub_features is not None:
                sub.observe(sub_features, start.index_select(0, rows))

    def _features(self, sub: Drafting, rows: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor | None:
        """The features `sub` reads `[B_k, W, n_k·H]` from the pass's `features` `[B, W, ·]`, or None."""
        if sub.feature_layers is None or features is None:
            return None
        mine = features.index_select(0, rows)
        if self.shared_layers:
            return mine
        assert self.feature_layers is not None
        # `hidden_states` as `target_features` reads them: the union's raw states in their places
        width = self.hidden_size
        states = [mine.new_empty(0)] * (self.num_layers + 1)
        for j, layer in enumerate(self.feature_layers):
            states[layer] = mine[..., j * width : (j + 1) * width]
        return target_features(self.target, states, sub.feature_layers)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` `[B']`, each sub its own (read on the host after the loop's sync)."""
        keep = rows.tolist()
        kept = set(keep)
        for k, sub in enumerate(self.subs):
            mine = [b for b, owner in enumerate(self.owners) if owner == k]
            local = [j for j, b in enumerate(mine) if b in kept]
            if len(local) != len(mine):
                sub.select_rows(torch.tensor(local, dtype=torch.long, device=self.device))
        self.owners = [self.owners[b] for b in keep]
        self._layout()


def ragged_drafting(
    target: PreTrainedModel,
    drafter: Drafter | RowDrafters,
    batch_size: int,
    capacity: int,
    lookup: DraftLookup | None,
    gamma: int = 0,
) -> Drafting:
    """The eager decoder's drafting on ragged caches of `capacity` slots (`MixedDrafting` for `RowDrafters`)."""
    if not isinstance(drafter, RowDrafters):
        return drafting_for(drafter, RaggedKVCache.for_model(drafter, batch_size, capacity), lookup, gamma)
    subs = [
        drafting_for(model, RaggedKVCache.for_model(model, drafter.owners.count(k), capacity), lookup, gamma)
        for k, model in enumerate(drafter.models)
    ]
    return MixedDrafting(target, subs, drafter.owners)
