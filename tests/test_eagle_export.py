"""The `eagle` feature-drafter layout and its export to vLLM's EAGLE-1 format: the exported folder,
run by an independent re-implementation of vLLM's `EagleLlamaForCausalLM` forward, gives the
drafter's own logits; what vLLM could not run is refused, and a refused export leaves nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specdecode import speculative_generate
from specdecode.models.config import DrafterConfig
from specdecode.models.draft_vocab import apply_draft_vocab_from_config
from specdecode.models.eagle_export import WEIGHTS_FILE, export_eagle
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
    drafter = derive_feature_drafter(target, kwargs.pop("num_layers", 1), layout=kwargs.pop("layout", "eagle"), **kwargs)
    with torch.no_grad():
        drafter.fc.weight.normal_(0, 0.4)
        for layer in drafter.body.get_decoder().layers:
            for p in layer.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.1)
    return drafter


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def vllm_eagle_forward(folder: Path, target: torch.nn.Module, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """vLLM's EAGLE-1 Llama drafter (vllm/model_executor/models/llama_eagle.py), from its definition
    and the exported files only: the target's embeddings, `fc` over [emb; feature], layers with
    vLLM's fused residual (the first layer without an input norm), the output `hidden + residual`
    with no final norm, the target's head. Causal attention, neox RoPE, grouped KV heads.
    `ids`, `features`: `[T]`, `[T, H]` (one sequence); returns logits `[T, V]`."""
    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / WEIGHTS_FILE))
    hidden, heads, kv_heads, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    head_dim = hidden // heads
    length = ids.shape[0]
    with torch.no_grad():
        h = torch.cat([target.get_input_embeddings()(ids), features], dim=-1) @ w["fc.weight"].T + w["fc.bias"]
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None]
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        residual = None
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            if residual is None:  # vLLM: the first layer's input norm is deleted
                residual, x = h, h
            else:
                residual = h + residual
                x = rms_norm(residual, w[p + "input_layernorm.weight"], eps)
            q = (x @ w[p + "self_attn.q_proj.weight"].T).view(length, heads, head_dim).transpose(0, 1)
            k = (x @ w[p + "self_attn.k_proj.weight"].T).view(length, kv_heads, head_dim).transpose(0, 1)
            v = (x @ w[p + "self_attn.v_proj.weight"].T).view(length, kv_heads, head_dim).transpose(0, 1)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
            scores = (q @ k.transpose(-1, -2)) / head_dim**0.5
            scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
            attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(length, hidden) @ w[p + "self_attn.o_proj.weight"].T
            residual = attn + residual
            x = rms_norm(residual, w[p + "post_attention_layernorm.weight"], eps)
            h = (F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        return (h + residual) @ target.get_output_embeddings().weight.T


@pytest.mark.parametrize("num_layers, draft_vocab", [(1, None), (2, None), (1, list(range(0, V, 2)))])
def test_exported_folder_run_as_vllm_does_gives_the_drafters_logits(target, tmp_path, num_layers, draft_vocab) -> None:
    drafter = trained_like(target, num_layers=num_layers, draft_vocab=draft_vocab)
    folder = export_eagle(drafter, target, tmp_path / "eagle")
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (9,), generator=generator)
    features = torch.randn(9, 32, generator=generator) * 2
    with torch.no_grad():
        ours = drafter.logits(drafter(features[None], ids[None]))[0]
    theirs = vllm_eagle_forward(folder, target, ids, features)
    if draft_vocab is not None:  # vLLM scores the full vocabulary; on the draft ids the logits agree
        theirs = theirs[:, draft_vocab]
        ours = ours[:, draft_vocab]
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    names = set(load_file(str(folder / WEIGHTS_FILE)))
    assert "fc.weight" in names and "embed_tokens.weight" in names
    assert "layers.0.input_layernorm.weight" not in names and "norm.weight" not in names
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == num_layers and config["architectures"] == ["LlamaForCausalLM"]
    assert "feature_drafter" not in config and "draft_vocab_ids" not in config


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
    expected = [target.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    result = speculative_generate(target, drafter, prompts, gamma=3, max_new_tokens=12, eos_token_ids=[])
    assert result.sequences == expected and result.stats.drafted > 0
    drafter.save_pretrained(tmp_path)
    restored = wrap_if_feature_drafter(apply_draft_vocab_from_config(AutoModelForCausalLM.from_pretrained(tmp_path)), tmp_path)
    assert restored.layout == "eagle"
    features, ids = torch.randn(2, 5, 32), torch.randint(0, V, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(restored.logits(restored(features, ids)), drafter.logits(drafter(features, ids)))


def test_refused_exports_name_the_reason_and_leave_nothing(target, tmp_path) -> None:
    cases = [
        (trained_like(target, layout="specdecode"), "layout 'specdecode'"),
        (trained_like(target, feature_layers=(1, -1)), "feature_layers=\\[-1\\]"),
    ]
    trained_embeddings = trained_like(target)
    with torch.no_grad():
        trained_embeddings.get_input_embeddings().weight.add_(0.01)
    cases.append((trained_embeddings, "embeddings differ"))
    trained_head = trained_like(target, draft_vocab=list(range(0, V, 2)))
    with torch.no_grad():
        trained_head.get_output_embeddings().weight.add_(0.01)
    cases.append((trained_head, "head differs"))
    for drafter, message in cases:
        with pytest.raises(ValueError, match=message):
            export_eagle(drafter, target, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "taken").mkdir()
    with pytest.raises(ValueError, match="exists"):
        export_eagle(trained_like(target), target, tmp_path / "taken")


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
