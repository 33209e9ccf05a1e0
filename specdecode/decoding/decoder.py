"""The one decoder interface: eager, static and compiled decoding implement it (`eager.py`,
`static.py`), and `decode.py` picks one per call from its options.

Each implementation runs both loops, speculative (drafter + target) and autoregressive (target
alone), on the same machinery: its rows (`rows.RowState`), its KV caches (`cache.KVCache`), one
commit rule for EOS and budgets, one verify step (`verify.verify_drafts`) and the drafting
strategies (`drafting.Drafting`), so a speedup measured between them compares like with like and
every core returns what the eager one does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdecode.decoding.lookup import PromptLookup
from specdecode.decoding.sampling import SamplingParams
from specdecode.decoding.stats import GenerationResult
from specdecode.models.feature_drafter import FeatureDrafter


@dataclass(frozen=True)
class Request:
    """A checked decode request: each prompt's token ids, its budget (`max_new_tokens`), the EOS ids,
    how tokens are drawn, and the generator they are drawn from (None: torch's global one)."""

    prompts: list[list[int]]
    budgets: list[int]
    eos: list[int]
    params: SamplingParams
    generator: torch.Generator | None


class Decoder(ABC):
    """A way to run the decode loops on checked arguments."""

    @abstractmethod
    def speculative(
        self,
        target: PreTrainedModel,
        drafter: PreTrainedModel | FeatureDrafter,
        request: Request,
        gamma: int,
        lookup: PromptLookup | None,
    ) -> GenerationResult:
        """Decode `request` with `drafter` proposing `gamma` tokens per target pass (`lookup`
        applied to its drafts where given): `speculative_generate`."""

    @abstractmethod
    def autoregressive(
        self, target: PreTrainedModel, request: Request, feature_layers: tuple[int, ...] | None
    ) -> GenerationResult:
        """Decode `request` with the target alone, with `feature_layers` its features of every token
        it read (`result.features`): `autoregressive_generate`."""

    def check_room(self, prompts: Sequence[Sequence[int]], budgets: Sequence[int], gamma: int | None) -> None:
        """Raise, before any work, where this decoder's caches cannot hold the rows (`gamma` None:
        the target alone). The eager caches are sized per call: they always can."""
