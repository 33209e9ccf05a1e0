"""Write a feature drafter in vLLM's EAGLE-1 format (`EagleLlamaForCausalLM`).

vLLM's EAGLE-1 drafter for Llama targets is the same model as an `eagle`-layout feature drafter
(`feature_drafter.py`, "Layouts"): `fc` (no bias) over `[embedding(x_{t+1}); f_t]`, where f_t is
the target's post-norm last hidden state; decoder layers, the first without its input norm; no
final norm; the target's LM head. SGLang's `LlamaForCausalLMEagle` is the same model with a bias
in `fc`. The folder written here is what both read as an EAGLE draft model: a Llama
`config.json` with the drafter's layer count and `model.safetensors` holding `fc.weight`, a zero
`fc.bias`, `layers.{i}.*` and `embed_tokens.weight`. Neither engine is run here: the tests check
the folder against a re-implementation of vLLM's forward.

vLLM shares the target's embeddings and LM head with the drafter (pipeline parallelism off), so
an exported drafter must not have trained either (the training default: `train.freeze_embeddings`,
`train.freeze_head`); `export_eagle` checks that against the target. vLLM's EAGLE-1 has no draft
vocabulary: a drafter trained with a truncated head drafts over the target's full vocabulary
there, whose logits on the draft ids are the same.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

from specdecode.models.config import LAST_FEATURE
from specdecode.models.draft_vocab import DraftVocabHead
from specdecode.models.feature_drafter import CONFIG_KEY, FeatureDrafter

WEIGHTS_FILE = "model.safetensors"
# config entries that only specdecode reads; vLLM gets a plain Llama config
_SPECDECODE_CONFIG_KEYS = (CONFIG_KEY, "draft_vocab_ids", "specdecode_gamma")


def export_eagle(drafter: FeatureDrafter, target: PreTrainedModel, folder: str | os.PathLike[str]) -> Path:
    """Write `drafter` to `folder` as a vLLM EAGLE-1 draft model; return the folder.

    Written to a temporary folder beside it, then renamed: a failed export leaves nothing behind.

    Raises:
        ValueError: the drafter is not an EAGLE-1 drafter (layout, features read, architecture),
            its embeddings or head differ from the target's (vLLM would use the target's), or
            `folder` exists.
    """
    folder = Path(folder)
    _check_exportable(drafter, target)
    if folder.exists():
        raise ValueError(f"export folder {str(folder)!r} exists; pick a new one")
    body = drafter.body
    # SGLang's EAGLE fc has a bias, vLLM's has none (and skips it): a zero bias serves both
    tensors = {"fc.weight": drafter.fc.weight, "fc.bias": torch.zeros_like(drafter.fc.weight[:, 0])}
    tensors["embed_tokens.weight"] = body.get_input_embeddings().weight
    for i, layer in enumerate(body.get_decoder().layers):
        for name, value in layer.state_dict().items():
            if i == 0 and name.startswith("input_layernorm."):
                continue  # bypassed in the eagle layout; vLLM's first layer has none
            tensors[f"layers.{i}.{name}"] = value
    config = body.config.to_dict()
    for key in _SPECDECODE_CONFIG_KEYS:
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["tie_word_embeddings"] = False

    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(staging / WEIGHTS_FILE))
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def _check_exportable(drafter: FeatureDrafter, target: PreTrainedModel) -> None:
    if not isinstance(drafter, FeatureDrafter):
        raise ValueError(f"only feature drafters export to EAGLE; got {type(drafter).__name__}")
    if drafter.layout != "eagle":
        raise ValueError(f"drafter layout {drafter.layout!r} has an input norm and a final norm that vLLM's EAGLE-1 "
                         "does not run; train it with drafter.layout=eagle")
    if tuple(drafter.feature_layers) != LAST_FEATURE:
        raise ValueError(f"drafter reads target layers {list(drafter.feature_layers)}; vLLM's EAGLE-1 passes the last "
                         "state only (feature_layers=[-1])")
    model_type = drafter.config.get_text_config().model_type
    if model_type != "llama":
        raise ValueError(f"drafter body is {model_type!r}; the export writes vLLM's EagleLlamaForCausalLM (llama only)")
    embeddings = drafter.get_input_embeddings().weight
    if embeddings.shape != target.get_input_embeddings().weight.shape or not torch.equal(
        embeddings.detach().cpu(), target.get_input_embeddings().weight.detach().cpu()
    ):
        raise ValueError("drafter embeddings differ from the target's, which vLLM uses in their place "
                         "(train with train.freeze_embeddings=true)")
    head = drafter.get_output_embeddings()
    target_head = target.get_output_embeddings().weight.detach().cpu()
    if isinstance(head, DraftVocabHead):
        same = head.bias is None and torch.equal(head.weight.detach().cpu(), target_head[head.draft_ids.cpu()])
    else:
        same = getattr(head, "bias", None) is None and torch.equal(head.weight.detach().cpu(), target_head)
    if not same:
        raise ValueError("drafter LM head differs from the target's, which vLLM uses in its place "
                         "(train with train.freeze_head=true)")
