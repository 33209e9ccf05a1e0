"""Checks of a saved model folder's files, so that a damaged one is named before transformers or
safetensors fail on it naming neither folder nor file (`SafetensorError: header too small`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

# Any of these makes a folder's tokenizer loadable by `AutoTokenizer.from_pretrained`.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def unreadable_safetensors(path: Path, error: BaseException) -> ValueError:
    """The error for a safetensors file that does not parse: the file, the cause, the likely reason."""
    return ValueError(
        f"{str(path)!r} is not a readable safetensors file ({error}): it is truncated, empty or "
        "damaged (an interrupted copy or save?); copy or save it again"
    )


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """`safetensors.torch.load_file(path)`; a ValueError names a file that does not parse."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise unreadable_safetensors(path, error) from None


def check_model_folder(folder: Path) -> None:
    """Check a local model folder before transformers reads it: `config.json` and every
    `.safetensors` header parse, and it has tokenizer files; a ValueError names the file."""
    config = folder / "config.json"
    if config.is_file():
        try:
            json.loads(config.read_text())
        except (ValueError, UnicodeDecodeError) as error:
            raise ValueError(f"{str(config)!r} is not valid JSON ({error}): the model folder is damaged") from None
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as handle:
                handle.keys()
        except (SafetensorError, OSError) as error:
            raise unreadable_safetensors(path, error) from None
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"model folder {str(folder)!r} has no tokenizer files (any of {', '.join(TOKENIZER_FILES)}); save the "
            "tokenizer beside the weights (`tokenizer.save_pretrained(folder)`, the target's for a drafter)"
        )
