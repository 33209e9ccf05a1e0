"""Shared fixtures: tiny random models and tokenizers built in-process (no hub), fp32, seeded."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdecode.pipeline.schemas import register_schemas
from tests.models_for_tests import tiny_llama_config as tiny_llama_config_


@pytest.fixture(autouse=True, scope="session")
def _single_thread_torch() -> None:
    """Run torch single-threaded, here and in the apps tests launch as subprocesses (which read
    OMP_NUM_THREADS): the test models are tiny, so threads buy nothing, and on a shared 2-core
    machine OpenMP oversubscription made the suite ~10x slower (3 s -> 30 s), and the demo's
    subprocesses ~3x (61 s alone -> 174 s beside one busy process)."""
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _kernel_picks_in_a_fresh_folder(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Kernel picks that a test measures (`skinny_matmul=None`, opt-in) are kept in a fresh folder per
    test (the apps a test runs in a subprocess too), never in the user's cache."""
    from specdecode.models.kernel_choice import KERNEL_CACHE_ENV

    monkeypatch.setenv(KERNEL_CACHE_ENV, str(tmp_path_factory.mktemp("cpu_kernels")))


@pytest.fixture(autouse=True, scope="session")
def _config_schemas() -> None:
    """conf/*.yaml name their dataclass schemas first in their defaults; tests compose them with
    Hydra's `compose`, as the apps do after `register_schemas()`."""
    register_schemas()


@pytest.fixture(scope="session")
def ragged_prompts() -> list[list[int]]:
    """Eight seeded random prompts of 1-12 ids below 64, of mixed lengths: a batch whose rows are
    padded differently (tests share it; none may change it)."""
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 64, (n,), generator=generator).tolist() for n in (3, 7, 1, 12, 5, 9, 2, 4)]


@pytest.fixture
def tiny_llama_config() -> LlamaConfig:
    """A fresh tiny LlamaConfig (see `tests.models_for_tests.tiny_llama_config`); tests may mutate it."""
    return tiny_llama_config_()


@pytest.fixture
def make_tiny_llama() -> Callable[..., LlamaForCausalLM]:
    """Factory `make_tiny_llama(seed=0, **config_overrides)` -> tiny LlamaForCausalLM in eval mode."""

    def make(seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
        torch.manual_seed(seed)
        return LlamaForCausalLM(tiny_llama_config_(**overrides)).eval()

    return make


@pytest.fixture
def make_tiny_tokenizer() -> Callable[..., PreTrainedTokenizerFast]:
    """Factory `make_tiny_tokenizer(words=None)` -> whitespace WordLevel tokenizer.

    Ids 0..2 are `<s>`, `</s>`, `<unk>`; then `words` (default `w3 .. w63`, 64 tokens in all).
    """

    def make(words: list[str] | None = None) -> PreTrainedTokenizerFast:
        words = words if words is not None else [f"w{i}" for i in range(3, 64)]
        vocab = {token: i for i, token in enumerate(["<s>", "</s>", "<unk>", *words])}
        backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
        backend.pre_tokenizer = WhitespaceSplit()
        return PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
        )

    return make
