"""EAGLE-3 drafters in specdecode's own loop: exact greedy decoding for Llama and Qwen2 targets, the
4H feature layout (raw target states, then the fed-back slot), the folder round trip through
`load_model`, and the checks on the target layers read. Their exports: tests/test_engine_export.py."""

from __future__ import annotations

import pytest
import torch

from specdecode import speculative_generate
from specdecode.models.draft_vocab import draft_vocab_ids
from specdecode.models.eagle3_drafter import (
    EAGLE3_FILE,
    Eagle3Drafter,
    check_eagle3_layers,
    default_feature_layers,
    derive_eagle3_drafter,
)
from specdecode.models.feature_drafter import check_fits_target, feed_back, target_features
from specdecode.models.loading import load_model
from specdecode.models.smoke import smoke_target, smoke_tokenizer
from tests.test_engine_export import V, eagle3_trained_like, tiny_target


@pytest.mark.parametrize("family, truncated", [("llama", True), ("qwen2", False)])
def test_greedy_decoding_is_the_targets(family, truncated) -> None:
    target = tiny_target(family, layers=6)
    drafter = eagle3_trained_like(target, list(range(0, V, 2)) if truncated else None)
    prompts = [[3, 9, 4], [7, 1, 1, 5, 2, 8, 6], [11]]
    expected = [
        target.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(p) :].tolist()
        for p in prompts
    ]
    result = speculative_generate(target, drafter, prompts, gamma=3, max_new_tokens=12, eos_token_ids=[])
    assert result.sequences == expected and result.stats.drafted > 0


def test_features_are_raw_states_then_the_fed_back_slot() -> None:
    target = tiny_target("llama", layers=6)
    drafter = derive_eagle3_drafter(target, feature_layers=(1, 3, 4))
    ids = torch.randint(0, V, (2, 5))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        features = target_features(target, states, drafter.feature_layers)
        assert features.shape[-1] == drafter.feature_width == 4 * 32
        assert torch.equal(features, torch.cat([states[1], states[3], states[4], torch.zeros_like(states[4])], -1))
        g = torch.randn(2, 5, 32)
        # a fed-back state reaches the layer as it is; target states through fc (untrained: the high one)
        assert torch.equal(drafter.fuse(feed_back(g, drafter.feature_width), ids)[..., 32:], g)
        torch.testing.assert_close(drafter.fuse(features, ids)[..., 32:], states[4])


def test_a_saved_drafter_loads_back_as_itself(tmp_path) -> None:
    target = smoke_target()
    drafter = derive_eagle3_drafter(target, feature_layers=(1, 2, 3), draft_vocab=list(range(0, 259, 3)))
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    drafter.save_pretrained(tmp_path)
    smoke_tokenizer().save_pretrained(tmp_path)
    assert (tmp_path / EAGLE3_FILE).is_file()
    restored, _ = load_model(tmp_path, skinny_matmul=False)
    assert isinstance(restored, Eagle3Drafter) and restored.feature_layers == (1, 2, 3)
    assert torch.equal(draft_vocab_ids(restored), draft_vocab_ids(drafter))
    features, ids = torch.randn(2, 6, 4 * 64), torch.randint(0, 259, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(restored.logits(restored(features, ids)), drafter.logits(drafter(features, ids)))
    check_fits_target(restored, target)
    with pytest.raises(ValueError, match="feature_layers"):
        check_fits_target(restored, smoke_target(num_layers=3))


def test_target_layers_are_checked() -> None:
    assert default_feature_layers(32) == (2, 16, 29)
    assert check_eagle3_layers([2, 16, 29], 32) == (2, 16, 29)
    for bad in ([2, 16], [2, 2, 29], [0, 16, 29], [2, 16, 32]):
        with pytest.raises(ValueError, match="expected three distinct target layers in \\[1, 31\\]"):
            check_eagle3_layers(bad, 32)
    with pytest.raises(ValueError, match="the target has 4"):
        derive_eagle3_drafter(smoke_target())  # (2, 2, 1): too few layers for the default
