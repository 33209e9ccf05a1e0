"""The drafting strategies' shared interface (specdecode.decoding.drafting.Drafting): each strategy
the loop can be given implements every method with the protocol's parameters."""

from __future__ import annotations

import inspect

import torch

from specdecode.decoding.cache import RaggedKVCache
from specdecode.decoding.drafting import Drafting, FeatureDrafting, SliceDrafting, drafting_for
from specdecode.models.feature_drafter import derive_feature_drafter
from tests.models_for_tests import tiny_llama

METHODS = ("prefill", "propose", "observe", "select_rows")


def test_every_drafting_strategy_implements_the_protocol() -> None:
    target = tiny_llama(2, seed=0)
    drafters = [tiny_llama(1, seed=1), derive_feature_drafter(target, 1)]
    strategies = [drafting_for(drafter, RaggedKVCache.for_model(drafter, 2, 16)) for drafter in drafters]
    assert [type(s) for s in strategies] == [SliceDrafting, FeatureDrafting]
    for strategy in strategies:
        assert isinstance(strategy, Drafting)
        assert strategy.looked_up.shape == () and strategy.looked_up.dtype == torch.long
        for name in METHODS:
            expected = list(inspect.signature(getattr(Drafting, name)).parameters)[1:]  # less self
            assert list(inspect.signature(getattr(strategy, name)).parameters) == expected, (
                type(strategy).__name__,
                name,
            )
