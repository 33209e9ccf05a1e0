"""The one decoder interface: eager, static and compiled decoding implement it on the same rows,
KV caches, verify step and drafting strategies; `decode.py` picks one per call."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdecode.decoding.adaptive import AdaptiveGamma
from specdecode.decoding.lookup import PromptLookup
from specdecode.decoding.mixed import RowDrafters
from specdecode.decoding.sampling import SamplingParams
from specdecode.decoding.stats import GenerationResult
from specdecode.models.feature_drafter import FeatureDrafter


@dataclass(frozen=True)
class Request:
    """A checked decode request; `generator` None draws from torch's global one."""

    prompts: list[list[int]]
    budgets: list[int]
    eos: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    # drafts per target pass (with `adaptive`, the widest step's); None: the target alone
    gamma: int | None = None
    # each step's gamma chosen while decoding (eager decoder); None: every step drafts `gamma`
    adaptive: AdaptiveGamma | None = None
    # with `adaptive`, each row's prior acceptance (a mixed batch's rows, by their drafters); None: its own
    priors: tuple[float, ...] | None = None
    # prompt lookup applied to the drafts; None: the drafter alone
    lookup: PromptLookup | None = None
    # the target's layers whose features a target-only decode returns (`result.features`); None: none
    feature_layers: tuple[int, ...] | None = None
    # a target-only decode's continuations of each prompt, one per temperature from one prefill
    # (row i * n + j: prompt i at temperatures[j]); None: one per prompt, drawn as `params` says
    temperatures: tuple[float, ...] | None = None


class Decoder(ABC):
    """A way to run the decode loops on a checked request."""

    @abstractmethod
    def speculative(
        self, target: PreTrainedModel, drafter: PreTrainedModel | FeatureDrafter | RowDrafters, request: Request
    ) -> GenerationResult:
        """Decode with `drafter` proposing `request.gamma` tokens per target pass: `speculative_generate`."""

    @abstractmethod
    def autoregressive(self, target: PreTrainedModel, request: Request) -> GenerationResult:
        """Decode with the target alone: `autoregressive_generate`."""

    def check_room(self, request: Request) -> None:
        """Raise, before any work, where this decoder's caches cannot hold the request's rows."""
