"""The decode loops: exactness against transformers greedy, stub models with known acceptance,
stopping rules, ragged batching, cache reuse, and bad input."""

from __future__ import annotations

import inspect

import pytest
import torch

from specdecode import autoregressive_generate, speculative_generate
from specdecode.decoding import DecodeOptions
from specdecode.decoding.eager import EagerDecoder
from specdecode.decoding.static import CompiledDecoder, StaticDecoder
from specdecode.models import derive_drafter
from tests.models_for_tests import tiny_llama
from tests.stubs import MarkovLM, successor_table

V = 64


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(2, seed=0)


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("drafter_kind", ["self", "random", "derived"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_matches_transformers_greedy(target, ragged_prompts, drafter_kind, gamma) -> None:
    if drafter_kind == "self":
        drafter = target
    elif drafter_kind == "random":
        drafter = tiny_llama(1, seed=1)
    else:
        from specdecode.models import derive_drafter

        drafter = derive_drafter(target, 1)
    expected = [hf_greedy(target, p, 24) for p in ragged_prompts]

    batched = speculative_generate(target, drafter, ragged_prompts, gamma=gamma, max_new_tokens=24, eos_token_ids=[])
    single = speculative_generate(target, drafter, ragged_prompts[:1], gamma=gamma, max_new_tokens=24, eos_token_ids=[])
    # the drafter alone, without prompt lookup (on by default; a looked-up draft can be rejected)
    alone = speculative_generate(
        target, drafter, ragged_prompts, gamma=gamma, max_new_tokens=24, eos_token_ids=[], prompt_lookup=None
    )

    assert batched.sequences == expected
    assert single.sequences == expected[:1]
    assert alone.sequences == expected
    assert batched.stats.looked_up > 0 and alone.stats.looked_up == 0
    if drafter_kind == "self":
        assert alone.stats.alpha == 1.0
        assert alone.stats.accepted_length_histogram[:gamma] == [0] * gamma
    else:
        assert alone.stats.alpha < 1.0


def test_autoregressive_matches_transformers_greedy(target, ragged_prompts) -> None:
    result = autoregressive_generate(target, ragged_prompts, max_new_tokens=17, eos_token_ids=[])
    assert result.sequences == [hf_greedy(target, p, 17) for p in ragged_prompts]
    assert result.stats.tau == 1.0
    assert result.stats.target_calls == 17


@pytest.mark.parametrize("layers", [(-1,), (0, -1)])
def test_autoregressive_features_are_the_targets_own(target, ragged_prompts, layers) -> None:
    """With `feature_layers`, target-only decoding returns the features of every token it read, as
    a forward over each row's whole text computes them (a ragged batch, per-row budgets including 0,
    rows stopped by EOS), the unread last token's row zero, and the same tokens as without."""
    budgets = [9, 0, 14, 5, 11, 1, 8, 12]
    plain = autoregressive_generate(target, ragged_prompts, max_new_tokens=budgets, eos_token_ids=[])
    eos = plain.sequences[2][4]  # stops row 2 (and any row that writes it) early
    plain = autoregressive_generate(target, ragged_prompts, max_new_tokens=budgets, eos_token_ids=[eos])
    result = autoregressive_generate(
        target, ragged_prompts, max_new_tokens=budgets, eos_token_ids=[eos], feature_layers=layers
    )
    assert result.sequences == plain.sequences and plain.features is None
    assert len(result.sequences[2]) == 5 and result.sequences[1] == []
    assert result.features is not None
    _assert_the_targets_features(target, ragged_prompts, result.sequences, result.features, layers)


def _assert_the_targets_features(target, prompts, sequences, features, layers) -> None:
    """Each row's `features` are those a forward over its prompt and `sequences` row computes, but
    the unread last token's, which is zero."""
    from specdecode.models.feature_drafter import target_features

    for prompt, generated, row in zip(prompts, sequences, features, strict=True):
        text = torch.tensor([prompt + generated])
        with torch.no_grad():
            hidden = target(input_ids=text, output_hidden_states=True).hidden_states
        expected = target_features(target, hidden, layers)[0]
        assert row.shape == expected.shape
        read = len(prompt) + max(len(generated) - 1, 0)
        torch.testing.assert_close(row[:read], expected[:read], atol=1e-5, rtol=1e-4)
        assert not generated or row[-1].eq(0).all()


def test_continuations_at_several_temperatures_share_one_prefill(target, ragged_prompts) -> None:
    """`temperatures=[...]` continues each prompt once per temperature from one prefill (row i * n + j:
    prompt i at the j-th): greedy rows are the target's greedy continuations token for token while
    sampled rows around them leave early at EOS, and every row's features are its own text's."""
    budgets = [9, 0, 14, 5, 11, 1, 8, 12]
    eos = list(range(0, 64, 4))  # a sampled row soon writes one of these and leaves the batch
    greedy = autoregressive_generate(target, ragged_prompts, max_new_tokens=budgets, eos_token_ids=eos)
    result = autoregressive_generate(
        target,
        ragged_prompts,
        max_new_tokens=budgets,
        eos_token_ids=eos,
        temperatures=[1.5, 0.0, 1.5],
        seed=0,
        feature_layers=(-1,),
    )
    assert len(result.sequences) == 3 * len(ragged_prompts)
    assert result.sequences[1::3] == greedy.sequences
    sampled = result.sequences[0::3] + result.sequences[2::3]
    assert sampled != greedy.sequences * 2 and all(len(s) <= b for s, b in zip(sampled, budgets * 2))
    # a sampled row left at EOS while its greedy sibling wrote on: rows left one by one, not in threes
    siblings = [(s, result.sequences[k - k % 3 + 1]) for k, s in enumerate(result.sequences) if k % 3 != 1]
    assert any(s and s[-1] in eos and len(s) < len(g) for s, g in siblings)
    assert (
        autoregressive_generate(target, ragged_prompts[:2], max_new_tokens=0, temperatures=[0.0, 0.7]).sequences
        == [[]] * 4
    )
    assert result.features is not None
    prompts = [p for p in ragged_prompts for _ in range(3)]
    _assert_the_targets_features(target, prompts, result.sequences, result.features, (-1,))


def test_continuations_at_several_temperatures_follow_the_target() -> None:
    """The sampled rows of a fanned-out batch follow the target at their own temperature (the G-test
    of tests/test_verify.py) and its greedy rows are its argmax path, in one batch."""
    from specdecode.decoding.sampling import SamplingParams
    from tests.test_verify import (
        N_SAMPLES,
        N_TOKENS,
        PROMPT,
        SIGNIFICANCE,
        VOCAB,
        exact_joint,
        g_test_pvalue,
        joint_counts,
    )

    target = tiny_llama(2, seed=11, vocab_size=VOCAB, init=0.3)
    greedy = autoregressive_generate(target, [PROMPT], max_new_tokens=N_TOKENS, eos_token_ids=[]).sequences[0]
    result = autoregressive_generate(
        target,
        [PROMPT] * (N_SAMPLES // 2),
        max_new_tokens=N_TOKENS,
        eos_token_ids=[],
        temperatures=[0.7, 0.0, 0.7],
        seed=0,
    )
    assert result.sequences[1::3] == [greedy] * (N_SAMPLES // 2)
    sampled = result.sequences[0::3] + result.sequences[2::3]
    assert g_test_pvalue(joint_counts(sampled), exact_joint(target, SamplingParams(0.7))) > SIGNIFICANCE


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(temperatures=[]), r"temperatures must be a non-empty list of temperatures, got \[\]"),
        (dict(temperatures=0.7), r"temperatures must be a non-empty list of temperatures, got 0.7"),
        (dict(temperatures=[0.0, -1.0]), r"temperature must be .*, got -1.0"),
        (
            dict(temperatures=[0.0, 0.7], temperature=0.7),
            r"give temperature or temperatures, not both: temperature=0.7",
        ),
        (dict(temperatures=[0.0, 0.7], static=True, compile=False), r"need the eager decoder: static=False"),
    ],
)
def test_bad_continuation_temperatures_are_named_before_any_work(target, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        autoregressive_generate(target, [[1, 2]], max_new_tokens=3, **kwargs)


def test_batched_equals_per_row(target, ragged_prompts) -> None:
    """Under fp32 greedy, a row's output must not depend on the rows batched with it."""
    drafter = tiny_llama(1, seed=3)
    batched = speculative_generate(target, drafter, ragged_prompts, gamma=3, max_new_tokens=20, eos_token_ids=[])
    for prompt, sequence in zip(ragged_prompts, batched.sequences):
        alone = speculative_generate(target, drafter, [prompt], gamma=3, max_new_tokens=20, eos_token_ids=[])
        assert alone.sequences == [sequence]


# --- stub models with fixed logits: acceptance is known exactly ---------------------------------


def greedy_reference(target_next: list[int], drafter_next: list[int], start: int, n_tokens: int, gamma: int):
    """Per-token reference of greedy speculative decoding on Markov stubs: (tokens, histogram, target calls)."""
    tokens = [target_next[start]]  # the prefill's token
    histogram = [0] * (gamma + 1)
    calls = 1
    while len(tokens) < n_tokens:
        current, accepted = tokens[-1], 0
        draft = []
        for _ in range(gamma):
            draft.append(drafter_next[current if not draft else draft[-1]])
        previous = current
        for d in draft:
            if d != target_next[previous]:
                break
            accepted += 1
            previous = d
        histogram[accepted] += 1
        calls += 1
        tokens += draft[:accepted] + [target_next[previous]]
    return tokens[:n_tokens], histogram, calls


def stub_pair(drafter_steps: list[int]) -> tuple[MarkovLM, MarkovLM, list[int], list[int]]:
    vocab = len(drafter_steps)
    target = MarkovLM(successor_table(vocab, 1))
    drafter = MarkovLM(successor_table(vocab, drafter_steps))
    target_next = [(v + 1) % vocab for v in range(vocab)]
    drafter_next = [(v + s) % vocab for v, s in enumerate(drafter_steps)]
    return target, drafter, target_next, drafter_next


@pytest.mark.parametrize(
    "case, drafter_steps",
    [
        ("always", [1] * 16),
        ("never", [2] * 16),
        ("sometimes", [1 if v % 3 else 2 for v in range(16)]),
    ],
)
def test_stub_acceptance_is_exact(case, drafter_steps) -> None:
    target, drafter, target_next, drafter_next = stub_pair(drafter_steps)
    gamma, n_tokens = 4, 30
    tokens, histogram, calls = greedy_reference(target_next, drafter_next, 5, n_tokens, gamma)

    result = speculative_generate(target, drafter, [[0, 5]], gamma=gamma, max_new_tokens=n_tokens, eos_token_ids=[])

    assert result.sequences == [tokens]
    assert result.stats.accepted_length_histogram == histogram
    assert result.stats.target_calls == calls
    assert result.stats.drafter_calls == 1 + (calls - 1) * gamma
    if case == "always":
        assert result.stats.alpha == 1.0 and histogram[:gamma] == [0] * gamma
    elif case == "never":
        assert result.stats.alpha == 0.0 and result.stats.tau == 1.0
        assert result.stats.target_calls == n_tokens
    else:
        assert 0.0 < result.stats.alpha < 1.0
        accepted = sum(n * c for n, c in enumerate(histogram))
        assert result.stats.alpha == accepted / (accepted + sum(histogram[:gamma]))


def test_rows_keep_their_own_accepted_length() -> None:
    """A row that accepts everything must not be held back by a row that accepts nothing."""
    steps = [1] * 8 + [2] * 8  # drafter right on tokens 0..7, wrong on 8..15
    target, drafter, target_next, drafter_next = stub_pair(steps)
    gamma, n_tokens = 4, 40
    prompts = [[0], [8]]
    per_row = [greedy_reference(target_next, drafter_next, p[0], n_tokens, gamma) for p in prompts]

    result = speculative_generate(target, drafter, prompts, gamma=gamma, max_new_tokens=n_tokens, eos_token_ids=[])

    assert result.sequences == [tokens for tokens, _, _ in per_row]
    # The batch runs as long as its slowest row, not longer (no roll-back to the batch minimum) ...
    assert result.stats.target_calls == max(calls for _, _, calls in per_row)
    # ... and each row's acceptance is its own.
    assert result.stats.accepted_length_histogram == [a + b for a, b in zip(per_row[0][1], per_row[1][1])]


def test_eos_stops_row_and_is_included() -> None:
    target, drafter, _, _ = stub_pair([1] * 16)
    result = speculative_generate(target, drafter, [[0], [3]], gamma=4, max_new_tokens=20, eos_token_ids=6)
    # Row 0 counts 1, 2, ... and stops at 6, even though 6 arrives mid-way through an accepted block.
    assert result.sequences[0] == [1, 2, 3, 4, 5, 6]
    assert result.sequences[1] == [4, 5, 6]


def test_any_of_several_eos_ids_stops() -> None:
    target, drafter, _, _ = stub_pair([1] * 16)
    result = speculative_generate(target, drafter, [[0], [9]], gamma=3, max_new_tokens=20, eos_token_ids=[12, 4])
    assert result.sequences == [[1, 2, 3, 4], [10, 11, 12]]
    ar = autoregressive_generate(target, [[0], [9]], max_new_tokens=20, eos_token_ids=[12, 4])
    assert ar.sequences == result.sequences


def test_default_eos_comes_from_the_model() -> None:
    target = MarkovLM(successor_table(16, 1), eos_token_id=3)
    drafter = MarkovLM(successor_table(16, 1))
    assert speculative_generate(target, drafter, [[0]], gamma=2, max_new_tokens=10).sequences == [[1, 2, 3]]


def test_per_row_budgets_and_finished_rows_leave_the_batch() -> None:
    target, drafter, _, _ = stub_pair([2] * 16)  # never accepted: one token per target call
    result = speculative_generate(target, drafter, [[0], [0], [0]], gamma=2, max_new_tokens=[2, 9, 0], eos_token_ids=[])
    assert [len(s) for s in result.sequences] == [2, 9, 0]
    # Once row 0 (and the empty row 2) finish, the target only sees the last active row.
    assert target.input_shapes[0][0] == 3
    assert target.input_shapes[-1][0] == 1


def test_zero_budget_returns_empty_without_model_calls() -> None:
    target, drafter, _, _ = stub_pair([1] * 16)
    result = speculative_generate(target, drafter, [[1, 2]], gamma=2, max_new_tokens=0)
    assert result.sequences == [[]]
    assert target.input_shapes == [] and drafter.input_shapes == []


def test_caches_are_reused_never_recomputed(target, ragged_prompts) -> None:
    """Each step feeds the target only the pending token and the gamma drafts; prompts are read once."""
    drafter = tiny_llama(1, seed=1)
    fed: list[tuple[int, int]] = []
    handle = target.register_forward_pre_hook(
        lambda m, args, kwargs: fed.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        gamma = 3
        result = speculative_generate(target, drafter, ragged_prompts, gamma=gamma, max_new_tokens=16, eos_token_ids=[])
    finally:
        handle.remove()
    longest = max(len(p) for p in ragged_prompts)
    assert fed[0] == (len(ragged_prompts), longest)
    assert all(width == gamma + 1 for _, width in fed[1:])
    assert len(fed) == result.stats.target_calls


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, needle",
    [
        (dict(gamma=0), ValueError, "gamma"),
        (dict(max_new_tokens=-1), ValueError, "-1"),
        (dict(prompts=[]), ValueError, "empty"),
        (dict(prompts=[[1], []]), ValueError, "prompt 1 is empty"),
        (dict(prompts=[[1, 99]]), ValueError, "99"),
        (dict(prompts=[[1, -2]]), ValueError, "-2"),
        (dict(prompts=[[1] * 250], max_new_tokens=10), ValueError, "context of 256"),
        (dict(temperature=-0.5), ValueError, "-0.5"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.5), ValueError, "1.5"),
        (dict(top_k=-3), ValueError, "-3"),
        (dict(prompts="hello"), TypeError, "str"),
        (dict(eos_token_ids=[64]), ValueError, "64"),
        (dict(prompt_lookup=True), TypeError, "prompt_lookup must be a PromptLookup or None, got True"),
    ],
)
def test_bad_input_is_named_before_any_work(target, kwargs, error, needle) -> None:
    drafter = tiny_llama(1, seed=1)
    calls: list[int] = []
    handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
    args = dict(prompts=[[1, 2, 3]], gamma=2, max_new_tokens=4) | kwargs
    try:
        with pytest.raises(error, match=needle):
            speculative_generate(target, drafter, args.pop("prompts"), **args)
    finally:
        handle.remove()
    assert calls == []


def test_mismatched_vocabularies_are_rejected(target) -> None:
    other = tiny_llama(1, seed=1, vocab_size=80)
    with pytest.raises(ValueError, match="vocab_size=64.*vocab_size=80"):
        speculative_generate(target, other, [[1, 2]], gamma=2, max_new_tokens=4)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(gamma=65), r"gamma must be an int in \[1, 64\], got 65"),
        (dict(gamma=100_000), "got 100000"),
        (dict(temperature=float("nan")), "temperature .* got nan"),
    ],
)
def test_gamma_bound_and_nan_temperature_are_named_before_any_work(target, kwargs, needle) -> None:
    calls: list[int] = []
    handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
    args = dict(gamma=2, max_new_tokens=8) | kwargs
    try:
        with pytest.raises(ValueError, match=needle):
            speculative_generate(target, tiny_llama(1, seed=1), [[1, 2, 3]], **args)
    finally:
        handle.remove()
    assert calls == []


def test_the_kv_cache_goes_by_the_keyword_this_transformers_takes() -> None:
    """transformers 5.24 takes a cache as `cache` and warns on `past_key_values` (to be removed):
    the decode passes of a target and of a feature drafter raise no such warning."""
    import warnings

    from specdecode.models.compat import CACHE_KWARG
    from tests.test_feature_drafter import random_feature_drafter

    target = tiny_llama(2, seed=0)
    assert CACHE_KWARG in inspect.signature(type(target.model).forward).parameters
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        autoregressive_generate(target, [[1, 2, 3]], max_new_tokens=3, eos_token_ids=[])
        speculative_generate(target, random_feature_drafter(target), [[1, 2, 3]], max_new_tokens=3, eos_token_ids=[])


class _PastKeyValuesOnly(torch.nn.Module):
    """A remote-code style causal LM: its forward names only the older `past_key_values`."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config, self.calls = inner, inner.config, []
        names = inspect.signature(type(inner.model).forward).parameters
        self.inner_keyword = "cache" if "cache" in names else "past_key_values"

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def run(self, cache, other: str, input_ids, attention_mask, position_ids, kwargs):
        # as such a model would: a cache under another name is not one it knows, and is lost
        self.calls.append(cache is not None and other not in kwargs)
        kwargs.pop(other, None)
        return self.inner(input_ids, attention_mask, position_ids, **{self.inner_keyword: cache}, **kwargs)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, **kwargs):
        return self.run(past_key_values, "cache", input_ids, attention_mask, position_ids, kwargs)


class _CacheOnly(_PastKeyValuesOnly):
    """A causal LM whose forward names only the newer `cache`."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, **kwargs):
        return self.run(cache, "past_key_values", input_ids, attention_mask, position_ids, kwargs)


class _KwargsOnly(torch.nn.Module):
    def forward(self, **kwargs):
        return kwargs


def test_a_model_gets_its_cache_by_the_keyword_its_own_forward_names(monkeypatch) -> None:
    """Targets whose forwards name only `past_key_values` (remote code written before transformers
    5.24) or only `cache` decode with their caches, whatever this transformers' models take."""
    from specdecode.models.compat import CACHE_KWARG, cache_keyword

    target = tiny_llama(2, seed=0)
    assert cache_keyword(target) == CACHE_KWARG and cache_keyword(_KwargsOnly()) == CACHE_KWARG
    prompts = [[1, 2, 3], [4, 5]]
    kwargs = dict(max_new_tokens=6, eos_token_ids=[])
    for wrapper, name in ((_PastKeyValuesOnly, "past_key_values"), (_CacheOnly, "cache")):
        model = wrapper(target)
        assert cache_keyword(model) == name
        for static in (False, True):
            want = autoregressive_generate(target, prompts, static=static, **kwargs).sequences
            assert autoregressive_generate(model, prompts, static=static, **kwargs).sequences == want
        assert model.calls and all(model.calls)


def test_options_given_whole_or_by_keyword_decode_alike(target, ragged_prompts) -> None:
    """`options=DecodeOptions(...)` and the same fields by keyword are one request; a keyword given
    beside `options` overrides its field."""
    drafter = derive_drafter(target, 1)
    kwargs = dict(max_new_tokens=8, eos_token_ids=[], gamma=2)
    by_keyword = speculative_generate(target, drafter, ragged_prompts, temperature=0.8, seed=3, **kwargs)
    whole = speculative_generate(
        target, drafter, ragged_prompts, options=DecodeOptions(temperature=0.8, seed=3), **kwargs
    )
    overridden = speculative_generate(
        target, drafter, ragged_prompts, options=DecodeOptions(temperature=0.8, seed=4), seed=3, **kwargs
    )
    assert whole.sequences == by_keyword.sequences == overridden.sequences
    alone = autoregressive_generate(
        target, ragged_prompts, max_new_tokens=8, options=DecodeOptions(seed=3, temperature=0.8)
    )
    assert (
        alone.sequences
        == autoregressive_generate(target, ragged_prompts, max_new_tokens=8, seed=3, temperature=0.8).sequences
    )


@pytest.mark.parametrize(
    "fields, decoder",
    [
        (dict(), EagerDecoder(record=False, on_step=None)),
        (dict(record=True), EagerDecoder(record=True, on_step=None)),
        (dict(static=True), StaticDecoder(capacity=None)),
        (dict(static=True, capacity=64, compile=False), StaticDecoder(capacity=64)),
        (dict(static=True, compile=True), CompiledDecoder(capacity=None)),
    ],
)
def test_the_options_choose_one_decoder(fields, decoder) -> None:
    chosen = DecodeOptions(**fields).decoder(torch.device("cpu"))
    assert type(chosen) is type(decoder) and chosen == decoder


@pytest.mark.parametrize(
    "options, error, needle",
    [
        (dict(temprature=0.5), TypeError, "temprature"),
        (dict(record="yes"), TypeError, "record"),
        (dict(static=True, on_step=print), ValueError, "eager"),
        (dict(top_k=-1), ValueError, "top_k"),
    ],
)
def test_bad_options_are_named_before_any_work(target, options, error, needle) -> None:
    drafter = derive_drafter(target, 1)
    with pytest.raises(error, match=needle):
        speculative_generate(target, drafter, [[1, 2]], max_new_tokens=4, **options)
    with pytest.raises(TypeError, match="DecodeOptions"):
        speculative_generate(target, drafter, [[1, 2]], max_new_tokens=4, options={"temperature": 0.5})
