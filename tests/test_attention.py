"""The decode passes' grouped-query attention: folded query heads compute transformers' SDPA attention."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from specdecode.decoding import attention
from specdecode.decoding.attention import FOLDED_GQA, folded_gqa, folded_gqa_attention
from specdecode.decoding.decode import autoregressive_generate, speculative_generate
from tests.models_for_tests import tiny_llama


class _Module(torch.nn.Module):
    """What the attention functions read of an attention layer."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _ragged_mask(lengths: list[int], width: int, slots: int, boolean: bool) -> torch.Tensor:
    """`[B, 1, T, S]`: query t of row b sees slots 0..lengths[b] + t."""
    positions = torch.tensor(lengths).unsqueeze(1) + torch.arange(width)
    visible = (torch.arange(slots).view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)
    if boolean:
        return visible
    return torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("width", [1, 5])
@pytest.mark.parametrize("boolean", [True, False])
def test_folded_heads_compute_the_repeated_heads_attention(width, boolean) -> None:
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, groups, slots, dim = 2, 3, 3, 24, 8
    query = torch.randn(batch, kv_heads * groups, width, dim, generator=generator)
    key = torch.randn(batch, kv_heads, slots, dim, generator=generator)
    value = torch.randn(batch, kv_heads, slots, dim, generator=generator)
    mask = _ragged_mask([7, 15], width, slots, boolean)
    module = _Module(groups).eval()

    folded, _ = folded_gqa_attention(module, query, key, value, mask, scaling=0.3)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask, scale=0.3
    ).transpose(1, 2)
    assert folded.shape == (batch, width, kv_heads * groups, dim)
    torch.testing.assert_close(folded, expected, rtol=1e-5, atol=1e-6)
    reference, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(folded, reference, rtol=1e-5, atol=1e-6)


def test_what_it_does_not_fold_goes_to_transformers_sdpa(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: calls.append(k) or ("hf", None))
    query, key = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    assert folded_gqa_attention(_Module(2).eval(), query, key, key, None)[0] == "hf"  # no mask: causal prefill
    assert folded_gqa_attention(_Module(2).train(), query, key, key, torch.ones(1, 1, 3, 3).bool())[0] == "hf"
    assert folded_gqa_attention(_Module(1).eval(), query, query, query, torch.ones(1, 1, 3, 3).bool())[0] == "hf"
    assert len(calls) == 3


def test_the_switch_covers_sdpa_models_only_and_restores_them() -> None:
    sdpa_model, eager_model = tiny_llama(1), tiny_llama(1)
    eager_model.config._attn_implementation = "eager"
    with pytest.raises(RuntimeError, match="inside"):
        with folded_gqa(sdpa_model, eager_model):
            assert sdpa_model.config._attn_implementation == FOLDED_GQA
            assert eager_model.config._attn_implementation == "eager"
            raise RuntimeError("inside")
    assert sdpa_model.config._attn_implementation == "sdpa"
    assert eager_model.config._attn_implementation == "eager"


def test_both_decode_loops_fold_and_agree() -> None:
    target, drafter = tiny_llama(2, seed=0), tiny_llama(1, seed=1)
    assert target.config.num_key_value_heads < target.config.num_attention_heads
    seen: list[str] = []
    for model in (target, drafter):
        layer = model.model.layers[0].self_attn
        layer.register_forward_hook(lambda module, args, out: seen.append(module.config._attn_implementation))
    prompts = [[3, 9, 4, 12, 7], [5, 6]]
    runs = [
        speculative_generate(target, drafter, prompts, max_new_tokens=12, gamma=3),
        autoregressive_generate(target, prompts, max_new_tokens=12),
        speculative_generate(target, drafter, prompts, max_new_tokens=12, gamma=3, static=True, compile=False),
        autoregressive_generate(target, prompts, max_new_tokens=12, static=True, compile=False),
    ]
    assert seen and set(seen) == {FOLDED_GQA}
    assert all(run.sequences == runs[0].sequences for run in runs)
    assert target.config._attn_implementation == drafter.config._attn_implementation == "sdpa"
