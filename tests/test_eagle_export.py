"""The `eagle` feature-drafter layout (EAGLE-1's, as vLLM and SGLang run it): which norms it skips,
exact decoding in the loop, the round trip through a folder. Its exports to the engines' formats
are tested in tests/test_engine_export.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdecode import speculative_generate
from specdecode.models.config import DrafterConfig
from specdecode.models.draft_vocab import apply_draft_vocab_from_config
from specdecode.models.feature_drafter import FeatureDrafter, derive_feature_drafter, wrap_if_feature_drafter
from tests.models_for_tests import tiny_llama

V = 64


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(3, seed=0)


def trained_like(target: torch.nn.Module, seed: int = 1, **kwargs) -> FeatureDrafter:
    """An `eagle` drafter with its trainable weights (fusion, layer) perturbed, as training would
    leave them; embeddings and head stay the target's (frozen)."""
    torch.manual_seed(seed)
    drafter = derive_feature_drafter(
        target, kwargs.pop("num_layers", 1), layout=kwargs.pop("layout", "eagle"), **kwargs
    )
    with torch.no_grad():
        drafter.fc.weight.normal_(0, 0.4)
        for layer in drafter.body.get_decoder().layers:
            for p in layer.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.1)
    return drafter


def test_eagle_layout_skips_the_first_input_norm_and_the_final_norm(target) -> None:
    """The same weights in the two layouts differ by exactly those two norms: with both norms'
    weights set so that they would change the output, only the specdecode layout reads them."""
    eagle = trained_like(target, layout="eagle")
    plain = trained_like(target, layout="specdecode")
    plain.load_state_dict(eagle.state_dict())
    features, ids = torch.randn(1, 6, 32), torch.randint(0, V, (1, 6))
    with torch.no_grad():
        before = eagle(features, ids)
        for norm in (eagle.body.get_decoder().norm, eagle.body.get_decoder().layers[0].input_layernorm):
            norm.weight.mul_(3.0)
        assert torch.equal(eagle(features, ids), before)
        assert not torch.allclose(plain(features, ids), before)
    assert not any(p.requires_grad for p in eagle.body.get_decoder().norm.parameters())


def test_eagle_layout_is_exact_in_the_loop_and_round_trips(target, tmp_path) -> None:
    drafter = trained_like(target, draft_vocab=list(range(0, V, 2)))
    prompts = [[3, 9, 4], [7, 1, 1, 5, 2, 8, 6], [11]]
    expected = [
        target.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(p) :].tolist()
        for p in prompts
    ]
    result = speculative_generate(target, drafter, prompts, gamma=3, max_new_tokens=12, eos_token_ids=[])
    assert result.sequences == expected and result.stats.drafted > 0
    drafter.save_pretrained(tmp_path)
    restored = wrap_if_feature_drafter(
        apply_draft_vocab_from_config(AutoModelForCausalLM.from_pretrained(tmp_path)), tmp_path
    )
    assert restored.layout == "eagle"
    features, ids = torch.randn(2, 5, 32), torch.randint(0, V, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(restored.logits(restored(features, ids)), drafter.logits(drafter(features, ids)))


def test_bad_layout_is_named(target) -> None:
    with pytest.raises(ValueError, match="layout='medusa'"):
        derive_feature_drafter(target, 1, layout="medusa")
    with pytest.raises(ValueError, match="drafter.layout"):
        DrafterConfig(kind="feature", layout="medusa")
    with pytest.raises(ValueError, match="only a feature drafter has a layout"):
        DrafterConfig(kind="derived", layout="eagle")


def test_untrained_eagle_drafter_passes_its_fused_input_through(target) -> None:
    """Copied from the target's layers, its layers' residual branches start at zero
    (derive_feature_drafter): the head reads the fused [emb; f] at a feature's scale, not the
    target's last layer's raw residual stream."""
    drafter = derive_feature_drafter(target, 2, init_from_layer=-1, layout="eagle")
    features, ids = torch.randn(1, 5, 32), torch.randint(0, V, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(drafter(features, ids), drafter.fuse(features, ids))
