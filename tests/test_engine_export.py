"""Exports to vLLM's and SGLang's EAGLE draft-model formats, for Llama and Qwen2 targets.

Neither engine runs here. Each folder is read by an independent re-implementation of that engine's
loader, written from its source (vLLM `model_executor/models/llama_eagle.py` and `llama_eagle3.py`,
SGLang `srt/models/llama_eagle.py`, `qwen2_eagle.py` and `llama_eagle3.py`, SGLang's EAGLE worker
for the hot-token map, both engines' capture of the target's states for EAGLE-3): the
parameters the engine's model declares, its `load_weights` name mapping (prefixes, q/k/v and
gate/up stacked into one matrix, names it skips) and its forward. Every weight written must land in
a declared parameter and every declared parameter must be filled (or be one the engine takes from
the target); the engine's logits must be the drafter's own to 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdecode.models.draft_vocab import draft_vocab_ids
from specdecode.models.eagle3_drafter import Eagle3Drafter, derive_eagle3_drafter
from specdecode.models.eagle_export import FORMATS, HOT_TOKEN_MAP_FILE, WEIGHTS_FILE, export_drafter
from specdecode.models.feature_drafter import FeatureDrafter, derive_feature_drafter, feed_back, target_features
from tests.models_for_tests import tiny_llama_config

V, H = 64, 32
STACKED = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]


def tiny_target(family: str, seed: int = 0, layers: int = 3) -> torch.nn.Module:
    """A target of `family` with a non-default rotary base, so a config that loses it shows."""
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )
    if family == "llama":
        return LlamaForCausalLM(
            tiny_llama_config(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        ).eval()
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
    return MistralForCausalLM(MistralConfig(**shape)).eval()


def trained_like(target: torch.nn.Module, num_layers: int = 1, draft_vocab=None, seed: int = 1) -> FeatureDrafter:
    """An eagle-layout drafter with every trainable weight (fusion, layers, biases) moved off its
    initialisation; embeddings and head stay the target's (frozen)."""
    torch.manual_seed(seed)
    drafter = derive_feature_drafter(target, num_layers, draft_vocab=draft_vocab, layout="eagle")
    with torch.no_grad():
        drafter.fc.weight.normal_(0, 0.4)
        for layer in drafter.body.get_decoder().layers:
            for p in layer.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.1)
    return drafter


# --- the engines' declared parameters and weight mapping -------------------------------------------


def _shapes(cfg: dict) -> tuple[int, int, int, int, int]:
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["hidden_size"], heads, kv, head_dim, cfg["intermediate_size"]


def declared_params(engine: str, cfg: dict) -> dict[str, tuple[int, ...]]:
    """The parameters the engine's EAGLE-1 model class declares for `cfg`, with their shapes.
    vLLM: EagleLlamaForCausalLM (q/k/v bias from `attention_bias`/`bias`, overridden by `qkv_bias`;
    o_proj bias from `attention_bias`/`bias`; fc without bias). SGLang: LlamaForCausalLMEagle (bias
    on q/k/v and o_proj from `attention_bias`) or Qwen2ForCausalLMEagle (q/k/v bias, none on o_proj),
    both with a biased fc and an LM head of `hot_vocab_size` rows."""
    hidden, heads, kv, head_dim, inter = _shapes(cfg)
    arch = cfg["architectures"][0]
    attention_bias = bool(cfg.get("attention_bias", False) or cfg.get("bias", False))
    if engine == "vllm":
        qkv_bias, o_bias, fc_bias = cfg.get("qkv_bias", attention_bias), attention_bias, False
    elif arch == "Qwen2ForCausalLMEagle":
        qkv_bias, o_bias, fc_bias = True, False, True
    else:
        qkv_bias, o_bias, fc_bias = attention_bias, attention_bias, True
    params = {"model.embed_tokens.weight": (cfg["vocab_size"], hidden), "model.fc.weight": (hidden, 2 * hidden)}
    if fc_bias:
        params["model.fc.bias"] = (hidden,)
    if engine == "sglang":
        params["lm_head.weight"] = (cfg.get("hot_vocab_size", cfg["vocab_size"]), hidden)
    qkv = (heads + 2 * kv) * head_dim
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        params |= {
            p + "self_attn.qkv_proj.weight": (qkv, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_up_proj.weight": (2 * inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "post_attention_layernorm.weight": (hidden,),
        }
        if i > 0:  # both engines delete the first layer's input norm
            params[p + "input_layernorm.weight"] = (hidden,)
        if qkv_bias:
            params[p + "self_attn.qkv_proj.bias"] = (qkv,)
        if o_bias:
            params[p + "self_attn.o_proj.bias"] = (hidden,)
    return params


def load_as_engine(engine: str, folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """`folder` loaded as the engine's `load_weights` does: vLLM prefixes `model.` to every name
    without `lm_head`, stacks shards, skips `embed_tokens` (pipeline parallelism off: the target's)
    and names its model lacks; SGLang skips `lm_head`, prefixes `model.` and stacks shards. Returns
    (config, packed parameters). Fails on a weight that lands nowhere or a parameter left empty."""
    cfg = json.loads((folder / "config.json").read_text())
    params = declared_params(engine, cfg)
    shards: dict[str, dict] = {}
    loaded: dict[str, torch.Tensor] = {}
    skipped = []
    for name, tensor in load_file(str(folder / WEIGHTS_FILE)).items():
        if "lm_head" in name:
            assert engine == "vllm", f"SGLang's EAGLE-1 skips {name}: the target's head is used"
        name = name if "lm_head" in name else "model." + name
        for packed, shard, shard_id in STACKED:
            if shard in name:
                name = name.replace(shard, packed)
                assert name in params, f"{engine}: no parameter {name} for a stacked shard"
                shards.setdefault(name, {})[shard_id] = tensor
                break
        else:
            if engine == "vllm" and "embed_tokens." in name:
                skipped.append(name)
                continue
            assert name in params, f"{engine}: the checkpoint's {name} matches no parameter of {cfg['architectures']}"
            loaded[name] = tensor
    for name, parts in shards.items():
        order = ["q", "k", "v"] if name.endswith(("qkv_proj.weight", "qkv_proj.bias")) else [0, 1]
        assert set(parts) == set(order), f"{name}: shards {sorted(map(str, parts))}"
        loaded[name] = torch.cat([parts[k] for k in order], dim=0)
    from_target = {"model.embed_tokens.weight", "lm_head.weight"}
    missing = set(params) - set(loaded) - from_target
    assert not missing, f"{engine}: parameters not in the checkpoint: {sorted(missing)}"
    for name, tensor in loaded.items():
        assert tuple(tensor.shape) == params[name], f"{name}: {tuple(tensor.shape)} != {params[name]}"
    return cfg, loaded


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style RoPE at positions 0..T-1 of `x` `[heads, T, head_dim]`."""
    head_dim, length = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = head_dim // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def eagle1_forward(
    cfg: dict, p: dict[str, torch.Tensor], embed: torch.Tensor, ids: torch.Tensor, features: torch.Tensor
) -> torch.Tensor:
    """Both engines' EAGLE-1 forward from packed parameters: `fc([emb; f])` (+ bias), layers with
    the fused residual (the first without an input norm), output `hidden + residual`, no final
    norm. `ids` `[T]`, `features` `[T, H]`; returns the hidden states `[T, H]` the head reads."""
    hidden, heads, kv, head_dim, inter = _shapes(cfg)
    theta, eps, length = cfg["rope_theta"], cfg["rms_norm_eps"], ids.shape[0]
    if "rope_parameters" in cfg:
        assert cfg["rope_parameters"]["rope_theta"] == theta
    h = torch.cat([embed[ids], features], -1) @ p["model.fc.weight"].T + p.get("model.fc.bias", 0)
    residual = None
    for i in range(cfg["num_hidden_layers"]):
        q_ = f"model.layers.{i}."
        if residual is None:
            residual, x = h, h
        else:
            residual = h + residual
            x = rms_norm(residual, p[q_ + "input_layernorm.weight"], eps)
        qkv = x @ p[q_ + "self_attn.qkv_proj.weight"].T + p.get(q_ + "self_attn.qkv_proj.bias", 0)
        q, k, v = qkv.split([heads * head_dim, kv * head_dim, kv * head_dim], -1)
        q = rotary(q.view(length, heads, head_dim).transpose(0, 1), theta)
        k = rotary(k.view(length, kv, head_dim).transpose(0, 1), theta).repeat_interleave(heads // kv, 0)
        v = v.view(length, kv, head_dim).transpose(0, 1).repeat_interleave(heads // kv, 0)
        scores = (q @ k.transpose(-1, -2)) / head_dim**0.5
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(length, heads * head_dim)
        attn = attn @ p[q_ + "self_attn.o_proj.weight"].T + p.get(q_ + "self_attn.o_proj.bias", 0)
        residual = attn + residual
        x = rms_norm(residual, p[q_ + "post_attention_layernorm.weight"], eps)
        gate, up = (x @ p[q_ + "mlp.gate_up_proj.weight"].T).split([inter, inter], -1)
        h = (F.silu(gate) * up) @ p[q_ + "mlp.down_proj.weight"].T
    return h + residual


def engine_draft(format: str, folder: Path, target: torch.nn.Module, ids: torch.Tensor, features: torch.Tensor):
    """The engine's draft logits and the target ids they score: vLLM over all V ids with the
    target's head; SGLang over the hot-token map's ids (the target's head rows at them) if the
    folder has one, else over all V."""
    engine = format.split("-")[0]
    cfg, params = load_as_engine(engine, folder)
    head = target.get_output_embeddings().weight.detach()
    scored = torch.arange(cfg["vocab_size"])
    if engine == "sglang" and (folder / HOT_TOKEN_MAP_FILE).is_file():
        scored = torch.as_tensor(torch.load(folder / HOT_TOKEN_MAP_FILE, weights_only=True), dtype=torch.long)
    with torch.no_grad():
        hidden = eagle1_forward(cfg, params, target.get_input_embeddings().weight.detach(), ids, features)
    return hidden @ head[scored].T, scored


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("format", ["vllm-eagle", "sglang-eagle"])
@pytest.mark.parametrize("num_layers, truncated", [(1, False), (2, True)])
def test_engine_reads_the_drafters_logits(tmp_path, family, format, num_layers, truncated) -> None:
    target = tiny_target(family)
    draft_vocab = list(range(1, V, 3)) if truncated else None
    drafter = trained_like(target, num_layers, draft_vocab)
    folder = export_drafter(drafter, target, tmp_path / "out", format, target_name="org/target")
    generator = torch.Generator().manual_seed(3)
    ids, features = torch.randint(0, V, (9,), generator=generator), torch.randn(9, H, generator=generator) * 2
    logits, scored = engine_draft(format, folder, target, ids, features)
    with torch.no_grad():
        ours = drafter.logits(drafter(features[None], ids[None]))[0]
    kept = torch.tensor(draft_vocab) if truncated else torch.arange(V)
    if format == "sglang-eagle":  # the truncation survives: it scores exactly the draft ids
        assert torch.equal(scored, kept)
    torch.testing.assert_close(logits[:, torch.isin(scored, kept)], ours[:, kept], atol=1e-4, rtol=1e-4)
    if format == "sglang-eagle" or not truncated:  # the engine's greedy draft is the drafter's
        assert torch.equal(scored[logits.argmax(-1)], ours.argmax(-1))
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == num_layers and cfg["rope_theta"] == 50000.0
    assert not {"feature_drafter", "draft_vocab_ids"} & set(cfg)
    expected = {
        ("vllm-eagle", "llama"): "LlamaForCausalLM",
        ("vllm-eagle", "qwen2"): "LlamaForCausalLM",
        ("sglang-eagle", "llama"): "LlamaForCausalLMEagle",
        ("sglang-eagle", "qwen2"): "Qwen2ForCausalLMEagle",
    }
    assert cfg["architectures"] == [expected[format, family]]
    assert cfg["model_type"] == ("qwen2" if (format, family) == ("sglang-eagle", "qwen2") else "llama")
    assert (folder / HOT_TOKEN_MAP_FILE).is_file() == (format == "sglang-eagle" and truncated)
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nbase_model: org/target\n") and "speculative" in card
    assert ("--speculative-token-map" in card) == (format == "sglang-eagle" and truncated)


def test_the_mapping_check_catches_a_misnamed_weight(tmp_path) -> None:
    """The re-implemented loader is strict: a weight under a name the engine does not map fails it."""
    target = tiny_target("llama")
    folder = export_drafter(trained_like(target), target, tmp_path / "out", "sglang-eagle")
    load_as_engine("sglang", folder)
    weights = load_file(str(folder / WEIGHTS_FILE))
    weights["layers.0.post_norm.weight"] = weights.pop("layers.0.post_attention_layernorm.weight")
    save_file(weights, str(folder / WEIGHTS_FILE))
    with pytest.raises(AssertionError, match="layers.0.post_norm.weight matches no parameter"):
        load_as_engine("sglang", folder)
    del weights["layers.0.post_norm.weight"]
    save_file(weights, str(folder / WEIGHTS_FILE))
    with pytest.raises(AssertionError, match="not in the checkpoint: .*post_attention_layernorm"):
        load_as_engine("sglang", folder)


def test_refused_exports_name_the_reason_and_leave_nothing(tmp_path) -> None:
    llama = tiny_target("llama")
    with pytest.raises(ValueError, match="format='tensorrt-eagle': expected one of vllm-eagle"):
        export_drafter(trained_like(llama), llama, tmp_path / "out", "tensorrt-eagle")
    mistral = tiny_target("mistral")
    with pytest.raises(ValueError, match="target family 'mistral' .* format 'sglang-eagle'; supported: llama\\|qwen2"):
        export_drafter(trained_like(mistral), mistral, tmp_path / "out", "sglang-eagle")
    qwen = tiny_target("qwen2")
    trained_embeddings = trained_like(qwen)
    trained_head = trained_like(qwen, draft_vocab=list(range(0, V, 2)))
    with torch.no_grad():
        trained_embeddings.get_input_embeddings().weight.add_(0.01)
        trained_head.get_output_embeddings().weight.add_(0.01)
    specdecode_layout = derive_feature_drafter(qwen, 1, layout="specdecode")
    multi_layer = derive_feature_drafter(qwen, 1, feature_layers=(1, -1))
    cases = [
        (trained_embeddings, "embeddings differ from the target's, which sglang-eagle uses"),
        (trained_head, "LM head differs from the target's"),
        (specdecode_layout, "layout 'specdecode'"),
        (multi_layer, "feature_layers=\\[-1\\]"),
        (qwen, "writes EAGLE-1 feature drafters .*got Qwen2ForCausalLM"),
    ]
    for drafter, message in cases:
        with pytest.raises(ValueError, match=message):
            export_drafter(drafter, qwen, tmp_path / "out", "sglang-eagle")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "taken").mkdir()
    with pytest.raises(ValueError, match="exists"):
        export_drafter(trained_like(llama), llama, tmp_path / "taken", "vllm-eagle")


def test_every_format_is_covered_here() -> None:
    assert set(FORMATS) == {"vllm-eagle", "sglang-eagle", "vllm-eagle3", "sglang-eagle3"}


# --- EAGLE-3 ---------------------------------------------------------------------------------------


def eagle3_declared_params(engine: str, cfg: dict) -> dict[str, tuple[int, ...]]:
    """vLLM's Eagle3LlamaForCausalLM (`model.layers.0.*`, a `draft_id_to_target_id` parameter) or
    SGLang's LlamaForCausalLMEagle3 (`model.midlayer.*`): q/k/v read 2H, fc reads 3 x
    `target_hidden_size`, an LM head of `draft_vocab_size` rows, a final norm."""
    hidden, heads, kv, head_dim, inter = _shapes(cfg)
    layer = "model.layers.0." if engine == "vllm" else "model.midlayer."
    params = {
        "model.embed_tokens.weight": (cfg["vocab_size"], hidden),
        "model.fc.weight": (hidden, 3 * cfg["target_hidden_size"]),
        layer + "self_attn.qkv_proj.weight": ((heads + 2 * kv) * head_dim, 2 * hidden),
        layer + "self_attn.o_proj.weight": (hidden, heads * head_dim),
        layer + "mlp.gate_up_proj.weight": (2 * inter, hidden),
        layer + "mlp.down_proj.weight": (hidden, inter),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (cfg["draft_vocab_size"], hidden),
        **{
            layer + f"{norm}.weight": (hidden,)
            for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm")
        },
    }
    if engine == "vllm":
        params["draft_id_to_target_id"] = (cfg["draft_vocab_size"],)
    return params


def load_as_eagle3_engine(engine: str, folder: Path) -> tuple[dict, dict[str, torch.Tensor], torch.Tensor]:
    """The engine's EAGLE-3 `load_weights`: `t2d` skipped; `d2t` into vLLM's `draft_id_to_target_id`
    (SGLang: its hot-token ids, d2t + arange); vLLM prefixes `model.` unless `lm_head` and maps
    `midlayer.` to `layers.0.`; SGLang takes a name as it is if its model has it, else with `model.`;
    both stack q/k/v and gate/up. Returns (config, packed parameters, the target id of each draft id)."""
    cfg = json.loads((folder / "config.json").read_text())
    params = eagle3_declared_params(engine, cfg)
    shards: dict[str, dict] = {}
    loaded: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(folder / WEIGHTS_FILE)).items():
        if name == "t2d":
            continue
        if name == "d2t":
            name = "draft_id_to_target_id" if engine == "vllm" else "hot_token_id"
            loaded[name] = tensor if engine == "vllm" else tensor + torch.arange(tensor.shape[0])
            continue
        if engine == "vllm":
            name = (name if "lm_head" in name else "model." + name).replace("midlayer.", "layers.0.")
        for packed, shard, shard_id in STACKED:
            if shard in name:
                name = name.replace(shard, packed)
                name = name if name in params or engine == "vllm" else "model." + name
                assert name in params, f"{engine}: no parameter {name} for a stacked shard"
                shards.setdefault(name, {})[shard_id] = tensor
                break
        else:
            name = name if name in params or engine == "vllm" else "model." + name
            assert name in params, f"{engine}: the checkpoint's {name} matches no parameter"
            loaded[name] = tensor
    for name, parts in shards.items():
        loaded[name] = torch.cat([parts[k] for k in (["q", "k", "v"] if "qkv" in name else [0, 1])], dim=0)
    missing = set(params) - set(loaded)
    assert not missing, f"{engine}: parameters not in the checkpoint: {sorted(missing)}"
    for name, shape in params.items():
        assert tuple(loaded[name].shape) == shape, f"{name}: {tuple(loaded[name].shape)} != {shape}"
    ids = (
        loaded.pop("draft_id_to_target_id") + torch.arange(cfg["draft_vocab_size"])
        if engine == "vllm"
        else loaded.pop("hot_token_id")
    )
    return cfg, loaded, ids


def eagle3_forward(
    cfg: dict, p: dict[str, torch.Tensor], layer: str, embeds: torch.Tensor, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both engines' EAGLE-3 step: `hidden` is the 3H target states (through `fc`) or an H-wide
    fed-back state (as it is); one layer whose attention reads [norm(embeds); hidden_norm(g)] and
    whose residual starts from g; returns (draft logits `[T, K]`, the pre-norm state fed back)."""
    size, heads, kv, head_dim, inter = _shapes(cfg)
    theta, eps, length = cfg["rope_theta"], cfg["rms_norm_eps"], embeds.shape[0]
    g = hidden @ p["model.fc.weight"].T if hidden.shape[-1] != embeds.shape[-1] else hidden
    x = torch.cat(
        [rms_norm(embeds, p[layer + "input_layernorm.weight"], eps), rms_norm(g, p[layer + "hidden_norm.weight"], eps)],
        -1,
    )
    q, k, v = (x @ p[layer + "self_attn.qkv_proj.weight"].T).split([heads * head_dim, kv * head_dim, kv * head_dim], -1)
    q = rotary(q.view(length, heads, head_dim).transpose(0, 1), theta)
    k = rotary(k.view(length, kv, head_dim).transpose(0, 1), theta).repeat_interleave(heads // kv, 0)
    v = v.view(length, kv, head_dim).transpose(0, 1).repeat_interleave(heads // kv, 0)
    scores = ((q @ k.transpose(-1, -2)) / head_dim**0.5).masked_fill(
        torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf")
    )
    residual = (
        g
        + (scores.softmax(-1) @ v).transpose(0, 1).reshape(length, heads * head_dim)
        @ p[layer + "self_attn.o_proj.weight"].T
    )
    gate, up = (
        rms_norm(residual, p[layer + "post_attention_layernorm.weight"], eps) @ p[layer + "mlp.gate_up_proj.weight"].T
    ).split([inter, inter], -1)
    prenorm = (F.silu(gate) * up) @ p[layer + "mlp.down_proj.weight"].T + residual
    return rms_norm(prenorm, p["model.norm.weight"], eps) @ p["lm_head.weight"].T, prenorm


def eagle3_trained_like(target: torch.nn.Module, draft_vocab=None, seed: int = 1) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = derive_eagle3_drafter(target, feature_layers=(1, 3, 4), draft_vocab=draft_vocab)
    with torch.no_grad():
        drafter.fc.weight.normal_(0, 0.3)
        for p in [*drafter.layer.parameters(), *drafter.get_output_embeddings().parameters()]:
            p.add_(torch.randn_like(p) * 0.1)
    return drafter


def assert_engine_runs_eagle3(target: torch.nn.Module, drafter: Eagle3Drafter, folder: Path, format: str) -> dict:
    """The engine captures the target states our features hold, and its first and fed-back steps
    give the drafter's logits at the draft ids it maps them to. Returns the engine's config."""
    engine = format.split("-")[0]
    cfg, params, draft_to_target = load_as_eagle3_engine(engine, folder)
    kept = draft_vocab_ids(drafter)
    assert torch.equal(draft_to_target, kept)

    width = target.config.hidden_size
    ids = torch.randint(0, target.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    captured = (
        cfg["eagle_aux_hidden_state_layer_ids"]
        if engine == "vllm"  # the input of each layer
        else [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    )  # the output of each
    aux = torch.cat([states[i][0, :-1] for i in captured], -1)
    next_ids = ids[0, 1:]
    layer = "model.layers.0." if engine == "vllm" else "model.midlayer."
    embeds = target.get_input_embeddings().weight.detach()[next_ids]
    with torch.no_grad():
        features = target_features(target, states, drafter.feature_layers)[:, :-1]
        assert torch.equal(features[0, :, : 3 * width], aux)
        theirs, fed = eagle3_forward(cfg, params, layer, embeds, aux)
        ours_hidden = drafter(features, next_ids[None])
        ours = drafter.logits(ours_hidden)[0]
        torch.testing.assert_close(theirs, ours[:, kept], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fed, ours_hidden[0], atol=1e-4, rtol=1e-4)
        assert torch.equal(draft_to_target[theirs.argmax(-1)], ours.argmax(-1))
        # the second draft step: each position's own pre-norm state fed back, no target state
        theirs, _ = eagle3_forward(cfg, params, layer, embeds, fed)
        ours = drafter.logits(drafter(feed_back(ours_hidden, drafter.feature_width), next_ids[None]))[0]
        torch.testing.assert_close(theirs, ours[:, kept], atol=1e-4, rtol=1e-4)
    assert cfg["draft_vocab_size"] == len(kept) and cfg["num_hidden_layers"] == 1
    return cfg


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("format", ["vllm-eagle3", "sglang-eagle3"])
@pytest.mark.parametrize("truncated", [False, True])
def test_eagle3_engine_reads_the_drafters_logits(tmp_path, family, format, truncated) -> None:
    """`assert_engine_runs_eagle3` on a drafter of either family, full or truncated vocabulary."""
    target = tiny_target(family, layers=6)
    draft_vocab = list(range(1, V, 3)) if truncated else None
    drafter = eagle3_trained_like(target, draft_vocab)
    folder = export_drafter(drafter, target, tmp_path / "out", format)
    cfg = assert_engine_runs_eagle3(target, drafter, folder, format)
    assert draft_vocab is None or draft_vocab_ids(drafter).tolist() == draft_vocab
    assert cfg["architectures"] == (["LlamaForCausalLM"] if format == "vllm-eagle3" else ["LlamaForCausalLMEagle3"])
    assert cfg["rope_theta"] == 50000.0


def test_eagle3_exports_refuse_other_drafters(tmp_path) -> None:
    target = tiny_target("qwen2", layers=6)
    with pytest.raises(ValueError, match="writes EAGLE-3 drafters .*got FeatureDrafter"):
        export_drafter(trained_like(target), target, tmp_path / "out", "vllm-eagle3")
    with pytest.raises(ValueError, match="writes EAGLE-1 feature drafters .*got Eagle3Drafter"):
        export_drafter(eagle3_trained_like(target), target, tmp_path / "out", "sglang-eagle")
    assert list(tmp_path.iterdir()) == []
