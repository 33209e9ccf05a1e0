"""Targets and drafters, the one import for them: loading (hub id, folder, .gguf, aliases), deriving
drafters from a target, and the checks a target and a drafter must pass to work together."""

from specdecode.models.compat import check_tokenizers, check_vocab_sizes, default_eos
from specdecode.models.config import SMOKE_TARGET, DrafterConfig, TargetConfig
from specdecode.models.draft_vocab import (
    DraftVocabHead,
    apply_draft_vocab_from_config,
    draft_vocab_ids,
    most_frequent_token_ids,
    pad_vocab,
    validate_draft_ids,
)
from specdecode.models.drafters import derive_drafter
from specdecode.models.eagle3_drafter import Eagle3Drafter, derive_eagle3_drafter
from specdecode.models.eagle_export import export_drafter
from specdecode.models.feature_drafter import FeatureDrafter, derive_feature_drafter
from specdecode.models.gguf_cache import DEFAULT_TARGET, cache_dir, default_target_gguf, gguf_to_hf_folder
from specdecode.models.loading import build_drafter, load_model, resolve_dtype

__all__ = [
    "DEFAULT_TARGET",
    "SMOKE_TARGET",
    "DraftVocabHead",
    "DrafterConfig",
    "Eagle3Drafter",
    "FeatureDrafter",
    "TargetConfig",
    "apply_draft_vocab_from_config",
    "build_drafter",
    "cache_dir",
    "check_tokenizers",
    "check_vocab_sizes",
    "default_eos",
    "default_target_gguf",
    "derive_drafter",
    "derive_eagle3_drafter",
    "derive_feature_drafter",
    "draft_vocab_ids",
    "export_drafter",
    "gguf_to_hf_folder",
    "load_model",
    "most_frequent_token_ids",
    "pad_vocab",
    "resolve_dtype",
    "validate_draft_ids",
]
