"""Write a trained feature drafter as a draft model that vLLM or SGLang loads: `export_drafter`.
Formats (engine method, `architectures`, draft vocabulary; each checked by tests/test_engine_export.py
against a re-implementation of that engine's loader and forward):
- `vllm-eagle`: `eagle`, `LlamaForCausalLM`; full vocabulary (the drafter's logits at its ids).
- `sglang-eagle`: `EAGLE`, `LlamaForCausalLMEagle` / `Qwen2ForCausalLMEagle`; `hot_token_map.pt`.
- `vllm-eagle3`: `eagle3`, `LlamaForCausalLM`; `lm_head` rows and `d2t`.
- `sglang-eagle3`: `EAGLE3`, `LlamaForCausalLMEagle3`; `lm_head` rows and `d2t`.
EAGLE-1 engines give the drafter the target's embeddings and head (so those must be the target's);
vLLM has no Qwen2 EAGLE-1 class, so a Qwen2 drafter is a Llama one with `attention_bias`. EAGLE-3
target layers: vLLM names each layer's input, SGLang (`eagle_config`) its output, one less.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel

from specdecode.core.atomic import atomic_folder
from specdecode.models.card import export_card
from specdecode.models.config import LAST_FEATURE
from specdecode.models.draft_vocab import DraftVocabHead, draft_vocab_ids
from specdecode.models.eagle3_drafter import Eagle3Drafter, NormedDraftHead, llama_config_like
from specdecode.models.feature_drafter import CONFIG_KEY, FeatureDrafter

WEIGHTS_FILE = "model.safetensors"
HOT_TOKEN_MAP_FILE = "hot_token_map.pt"
TARGET_FAMILIES = ("llama", "qwen2")
# config entries that only specdecode reads; the engines get a plain config
_SPECDECODE_CONFIG_KEYS = (
    CONFIG_KEY,
    "draft_vocab_ids",
    "specdecode_gamma",
    "specdecode_alpha",
    "specdecode_alpha_sampled",
)


@dataclass
class Exported:
    """What one format writes: `config.json`, `model.safetensors`, any other files, and how to serve it."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    files: dict[str, bytes] = field(default_factory=dict)
    engine: str = ""
    method: str = ""


def export_drafter(
    drafter: PreTrainedModel | FeatureDrafter,
    target: PreTrainedModel,
    folder: str | os.PathLike[str],
    format: str = "vllm-eagle",
    *,
    target_name: str | None = None,
    num_speculative_tokens: int | None = None,
) -> Path:
    """Write `drafter` to `folder` in `format` (one of `FORMATS`), atomically; return the folder.
    `target_name` and `num_speculative_tokens` (default: the drafter's gamma, else 3) fill its
    README's serve command. A ValueError, before anything is written, names an unknown format, a
    target or drafter the format cannot express, or an existing `folder`."""
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: expected one of {'|'.join(FORMATS)}")
    folder = Path(folder)
    if folder.exists():
        raise ValueError(f"export folder {str(folder)!r} exists; pick a new one")
    exported = FORMATS[format](drafter, target)
    gamma = num_speculative_tokens or getattr(drafter.config, "specdecode_gamma", None) or 3
    card = export_card(
        format,
        exported.engine,
        exported.method,
        exported.config,
        target_name,
        folder,
        int(gamma),
        HOT_TOKEN_MAP_FILE in exported.files,
    )
    with atomic_folder(folder) as staging:
        save_file(
            {k: v.detach().to("cpu").contiguous() for k, v in exported.tensors.items()}, str(staging / WEIGHTS_FILE)
        )
        (staging / "config.json").write_text(json.dumps(exported.config, indent=2, sort_keys=True) + "\n")
        for name, data in exported.files.items():
            (staging / name).write_bytes(data)
        (staging / "README.md").write_text(card)
    return folder


def target_family(model: PreTrainedModel | FeatureDrafter) -> str:
    """The model's family as the formats name it (`config.model_type` of its text config)."""
    return model.config.get_text_config().model_type


def _vllm_eagle(drafter: FeatureDrafter, target: PreTrainedModel) -> Exported:
    family = _check_eagle1(drafter, target, "vllm-eagle")
    if family == "llama":
        config = _plain_config(drafter)
    else:  # the same layer as a Llama one with q/k/v biases (and a zero o_proj bias)
        config = _with_legacy_rope(llama_config_like(drafter.config.get_text_config(), attention_bias=True).to_dict())
    config["architectures"] = ["LlamaForCausalLM"]
    tensors = _eagle1_tensors(drafter, fc_bias=False, o_proj_bias=config.get("attention_bias", False))
    return Exported(config, tensors, engine="vllm", method="eagle")


def _sglang_eagle(drafter: FeatureDrafter, target: PreTrainedModel) -> Exported:
    family = _check_eagle1(drafter, target, "sglang-eagle")
    config = _plain_config(drafter)
    config["architectures"] = ["LlamaForCausalLMEagle" if family == "llama" else "Qwen2ForCausalLMEagle"]
    files = {}
    if isinstance(drafter.get_output_embeddings(), DraftVocabHead):
        buffer = io.BytesIO()
        torch.save(draft_vocab_ids(drafter).to(torch.int64), buffer)
        files[HOT_TOKEN_MAP_FILE] = buffer.getvalue()
    return Exported(
        config, _eagle1_tensors(drafter, fc_bias=True, o_proj_bias=False), files, engine="sglang", method="EAGLE"
    )


def _vllm_eagle3(drafter: Eagle3Drafter, target: PreTrainedModel) -> Exported:
    config = _eagle3_config(drafter, target, "vllm-eagle3")
    config["architectures"] = ["LlamaForCausalLM"]
    # vLLM captures the input of each listed target layer: our ids as they are
    config["eagle_aux_hidden_state_layer_ids"] = list(drafter.feature_layers)
    config["norm_before_residual"] = False
    return Exported(config, _eagle3_tensors(drafter), engine="vllm", method="eagle3")


def _sglang_eagle3(drafter: Eagle3Drafter, target: PreTrainedModel) -> Exported:
    config = _eagle3_config(drafter, target, "sglang-eagle3")
    config["architectures"] = ["LlamaForCausalLMEagle3"]
    # SGLang's ids name a layer whose output it captures (the input of the next one): ours less one
    config["eagle_config"] = {
        "eagle_aux_hidden_state_layer_ids": [i - 1 for i in drafter.feature_layers],
        "use_aux_hidden_state": True,
    }
    return Exported(config, _eagle3_tensors(drafter), engine="sglang", method="EAGLE3")


# format → what it writes; each checks the drafter's kind itself, so that its refusal names the format
FORMATS: dict[str, Callable[[Any, PreTrainedModel], Exported]] = {
    "vllm-eagle": _vllm_eagle,
    "sglang-eagle": _sglang_eagle,
    "vllm-eagle3": _vllm_eagle3,
    "sglang-eagle3": _sglang_eagle3,
}


def _eagle3_config(drafter: Eagle3Drafter, target: PreTrainedModel, format: str) -> dict[str, Any]:
    """Both engines' EAGLE-3 config: one layer, the draft vocabulary's size, the target's hidden size."""
    if not isinstance(drafter, Eagle3Drafter):
        raise ValueError(f"format {format!r} writes EAGLE-3 drafters (drafter=eagle3); got {type(drafter).__name__}")
    check_family(target, format)
    _check_target_embeddings(drafter, target, format)
    config = _plain_config(drafter)
    config["num_hidden_layers"] = 1
    config["draft_vocab_size"] = len(draft_vocab_ids(drafter))
    config["target_hidden_size"] = target.config.get_text_config().hidden_size
    return config


def _eagle3_tensors(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """`midlayer.*`, `fc`, `norm`, `lm_head` (K draft rows), `d2t` (target id − draft id), `t2d`, `embed_tokens`."""
    head = cast(NormedDraftHead, drafter.get_output_embeddings())
    ids = draft_vocab_ids(drafter)
    t2d = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": drafter.fc.weight,
        "norm.weight": head.norm.weight,
        "lm_head.weight": head.weight,
        "d2t": ids - torch.arange(len(ids)),
        "t2d": t2d,
        "embed_tokens.weight": drafter.get_input_embeddings().weight,
    }
    tensors |= {f"midlayer.{name}": value for name, value in drafter.layer.state_dict().items()}
    return tensors


def _eagle1_tensors(drafter: FeatureDrafter, *, fc_bias: bool, o_proj_bias: bool) -> dict[str, torch.Tensor]:
    """`fc.weight` (+ a zero `fc.bias`), `embed_tokens.weight`, `layers.{i}.*` without the first
    layer's input norm (bypassed in the eagle layout, absent in both engines) and no final norm."""
    tensors = {"fc.weight": drafter.fc.weight}
    if fc_bias:
        tensors["fc.bias"] = torch.zeros_like(drafter.fc.weight[:, 0])
    tensors["embed_tokens.weight"] = drafter.get_input_embeddings().weight
    for i, layer in enumerate(drafter.body.get_decoder().layers):
        for name, value in layer.state_dict().items():
            if i == 0 and name.startswith("input_layernorm."):
                continue
            tensors[f"layers.{i}.{name}"] = value
        if o_proj_bias and f"layers.{i}.self_attn.o_proj.bias" not in tensors:
            tensors[f"layers.{i}.self_attn.o_proj.bias"] = torch.zeros_like(layer.self_attn.o_proj.weight[:, 0])
    return tensors


def _check_eagle1(drafter: FeatureDrafter, target: PreTrainedModel, format: str) -> str:
    """The family of an EAGLE-1-exportable drafter; a ValueError naming what is not."""
    if not isinstance(drafter, FeatureDrafter) or isinstance(drafter, Eagle3Drafter):
        raise ValueError(
            f"format {format!r} writes EAGLE-1 feature drafters (drafter=feature); got {type(drafter).__name__}"
        )
    family = check_family(target, format)
    if target_family(drafter) != family:
        raise ValueError(f"drafter body is {target_family(drafter)!r} but the target is {family!r}")
    if drafter.layout != "eagle":
        raise ValueError(
            f"drafter layout {drafter.layout!r} has an input norm and a final norm that EAGLE-1 does not "
            "run; train it with drafter.layout=eagle"
        )
    if tuple(drafter.feature_layers) != LAST_FEATURE:
        raise ValueError(
            f"drafter reads target layers {list(drafter.feature_layers)}; EAGLE-1 passes the last state "
            "only (feature_layers=[-1])"
        )
    text = drafter.config.get_text_config()
    if getattr(text, "use_sliding_window", False):
        raise ValueError(
            "drafter body uses sliding-window attention, which the EAGLE drafters of vLLM and SGLang do not run"
        )
    _check_shared_with_target(drafter, target, format)
    return family


def _check_target_embeddings(drafter: FeatureDrafter, target: PreTrainedModel, format: str) -> None:
    """The engines run the drafter with the target's embeddings: they must be the drafter's."""
    embeddings = drafter.get_input_embeddings().weight.detach().cpu()
    target_embeddings = cast(nn.Embedding, target.get_input_embeddings()).weight.detach().cpu()
    if embeddings.shape != target_embeddings.shape or not torch.equal(embeddings, target_embeddings):
        raise ValueError(
            f"drafter embeddings differ from the target's, which {format} uses in their place "
            "(train with train.freeze_embeddings=true)"
        )


def check_family(target: PreTrainedModel, format: str) -> str:
    """The target's family if `format` covers it; a ValueError naming both otherwise."""
    family = target_family(target)
    if family not in TARGET_FAMILIES:
        raise ValueError(
            f"target family {family!r} (config.model_type) is not supported by format {format!r}; "
            f"supported: {'|'.join(TARGET_FAMILIES)}"
        )
    return family


def _check_shared_with_target(drafter: FeatureDrafter, target: PreTrainedModel, format: str) -> None:
    """The engines replace the drafter's embeddings and LM head with the target's: they must match."""
    _check_target_embeddings(drafter, target, format)
    head = drafter.get_output_embeddings()
    target_head = target.get_output_embeddings().weight.detach().cpu()
    if isinstance(head, DraftVocabHead):
        same = head.bias is None and torch.equal(head.weight.detach().cpu(), target_head[head.draft_ids.cpu()])
    else:
        same = getattr(head, "bias", None) is None and torch.equal(head.weight.detach().cpu(), target_head)
    if not same:
        raise ValueError(
            f"drafter LM head differs from the target's, which {format} uses in its place "
            "(train with train.freeze_head=true)"
        )


def _plain_config(drafter: FeatureDrafter) -> dict[str, Any]:
    """The body's config as a plain HF config of its own family, without specdecode's entries."""
    config = drafter.body.config.to_dict()
    for key in _SPECDECODE_CONFIG_KEYS:
        config.pop(key, None)
    config["tie_word_embeddings"] = False
    return _with_legacy_rope(config)


def _with_legacy_rope(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with the rotary settings also as `rope_theta` / `rope_scaling`, which an engine on
    transformers 4 reads (5 writes `rope_parameters` only)."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return config
