"""The static-shape decode core (`static=True`): token for token the eager loops' output and
counters, fixed shapes with finished rows masked in place, the target's distribution when sampling,
bf16 greedy against target-alone greedy, and (marked slow: inductor compiles for seconds on a
CPU) the compiled steps, compiled once per shape."""

from __future__ import annotations

import contextlib

import pytest
import torch

import specdecode.decoding.compiled
import specdecode.decoding.drafting
import specdecode.decoding.lookup
import specdecode.decoding.rows
import specdecode.decoding.static
import specdecode.decoding.static_cache
import specdecode.decoding.verify
from specdecode import autoregressive_generate, speculative_generate
from specdecode.decoding.sampling import SamplingParams, sample
from specdecode.decoding.static_cache import StaticKVCache
from specdecode.decoding.verify import rejection_sample
from specdecode.models import derive_drafter
from tests.models_for_tests import tiny_llama
from tests.stubs import MarkovLM, successor_table
from tests.test_feature_drafter import random_feature_drafter
from tests.test_verify import (
    EAGER_LOOKUP,
    N_SAMPLES,
    N_TOKENS,
    PROMPT,
    SIGNIFICANCE,
    exact_joint,
    g_test_pvalue,
    joint_counts,
    mc_feature_drafter,
    mc_models,  # noqa: F401 (a fixture)
)

V = 64
# per-row budgets: a row of none, a row of one (done at the prefill), short and long rows
BUDGETS = [20, 3, 14, 20, 0, 9, 20, 1]


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(3, seed=0)


def drafter_of(kind: str, target: torch.nn.Module) -> torch.nn.Module:
    return derive_drafter(target, 1) if kind == "slice" else random_feature_drafter(target, feature_layers=(1, -1))


def counters(result) -> dict[str, object]:
    """A result's stats less the timings."""
    stats = result.stats.to_dict()
    del stats["wall_time_s"], stats["tokens_per_s"]
    return stats


@pytest.fixture(scope="module")
def early_eos(target, ragged_prompts) -> int:
    """A token that row 2's greedy continuation writes early: it stops that row (and any other that
    writes it) mid-way, while other rows run on."""
    return autoregressive_generate(target, ragged_prompts, max_new_tokens=BUDGETS, eos_token_ids=[]).sequences[2][4]


@pytest.mark.parametrize("kind", ["slice", "feature"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_static_greedy_equals_the_eager_loop(target, ragged_prompts, early_eos, kind, gamma) -> None:
    """A ragged batch of 8 with per-row budgets (0 and 1 among them) and an EOS that stops rows
    mid-way, with prompt lookup: the same tokens and the same counters (acceptance histogram,
    calls, looked-up drafts) as the eager loop, where finished rows leave the batch."""
    drafter = drafter_of(kind, target)
    kwargs = dict(gamma=gamma, max_new_tokens=BUDGETS, eos_token_ids=[early_eos])
    eager = speculative_generate(target, drafter, ragged_prompts, **kwargs)
    static = speculative_generate(target, drafter, ragged_prompts, static=True, **kwargs)
    assert static.sequences == eager.sequences
    assert counters(static) == counters(eager)
    assert len(eager.sequences[2]) == 5 and eager.sequences[4] == []
    assert 0 < eager.stats.accepted < eager.stats.drafted and eager.stats.looked_up > 0


@pytest.mark.parametrize("layers", [None, (0, -1)])
def test_static_autoregressive_equals_the_eager_loop(target, ragged_prompts, early_eos, layers) -> None:
    """Target alone, and the training-data writer (`feature_layers`): the same tokens, counters and
    features (the unread last token's row zero), with rows stopped by budget and EOS."""
    kwargs = dict(max_new_tokens=BUDGETS, eos_token_ids=[early_eos], feature_layers=layers)
    eager = autoregressive_generate(target, ragged_prompts, **kwargs)
    static = autoregressive_generate(target, ragged_prompts, static=True, **kwargs)
    assert static.sequences == eager.sequences and counters(static) == counters(eager)
    if layers is not None:
        assert len(static.features) == len(eager.features)
        for ours, theirs in zip(static.features, eager.features):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
            assert ours[-1].eq(0).all() == theirs[-1].eq(0).all()


def test_shapes_are_fixed_and_finished_rows_stay_masked() -> None:
    """Every pass after the prefill has the whole batch and one width, finished rows included (the
    eager loop drops them); the mask is boolean over the whole capacity."""
    target = MarkovLM(successor_table(16, 1))
    drafter = MarkovLM(successor_table(16, [2] * 16))  # never accepted: one token per pass
    masks: list[torch.Tensor] = []
    handle = target.register_forward_pre_hook(
        lambda m, args, kwargs: masks.append(kwargs["attention_mask"]), with_kwargs=True
    )
    try:
        result = speculative_generate(
            target, drafter, [[0], [0], [0]], gamma=2, max_new_tokens=[2, 9, 0], eos_token_ids=[], static=True
        )
    finally:
        handle.remove()
    assert [len(s) for s in result.sequences] == [2, 9, 0]
    assert set(target.input_shapes[1:]) == {(3, 3)} and len(target.input_shapes) == result.stats.target_calls
    assert all(m.dtype == torch.bool and m.shape[-1] == specdecode.decoding.static_cache.MIN_CAPACITY for m in masks)
    assert len({m.shape for m in masks[1:]}) == 1


def test_finished_rows_look_nothing_up() -> None:
    """Lookup wherever one earlier token matches (prompts that repeat themselves): rows that
    finished early stay in the static batch, yet their drafts are not counted as looked up."""
    target = MarkovLM(successor_table(16, 1))
    drafter = MarkovLM(successor_table(16, [2] * 16))
    prompts, budgets = [[0, 1, 2, 3, 0, 1]] * 3, [2, 12, 0]
    kwargs = dict(gamma=2, max_new_tokens=budgets, eos_token_ids=[], prompt_lookup=EAGER_LOOKUP)
    eager = speculative_generate(target, drafter, prompts, **kwargs)
    static = speculative_generate(target, drafter, prompts, static=True, **kwargs)
    assert static.sequences == eager.sequences and counters(static) == counters(eager)
    assert eager.stats.looked_up > 0


def test_sync_every_k_steps_overruns_by_less_than_k(target, ragged_prompts, early_eos, monkeypatch) -> None:
    """With a host sync every k steps the batch may run up to k - 1 steps past its last row's end:
    the output and the counters are unchanged (the extra steps are fully masked)."""
    monkeypatch.setattr(specdecode.decoding.static, "default_sync_every", lambda device: 5)
    drafter = drafter_of("slice", target)
    kwargs = dict(gamma=2, max_new_tokens=BUDGETS, eos_token_ids=[early_eos])
    eager = speculative_generate(target, drafter, ragged_prompts, **kwargs)
    static = speculative_generate(target, drafter, ragged_prompts, static=True, **kwargs)
    assert static.sequences == eager.sequences and counters(static) == counters(eager)


def test_bf16_speculative_greedy_equals_target_alone_in_bf16(ragged_prompts) -> None:
    """What exact means in bf16: greedy speculative output equals target-alone greedy computed in
    bf16 on the same batch (near-ties aside, which this wide-init model does not have)."""
    target = tiny_llama(3, seed=0).to(torch.bfloat16)
    drafter = random_feature_drafter(target, feature_layers=(1, -1))
    alone = autoregressive_generate(target, ragged_prompts, max_new_tokens=16, eos_token_ids=[], static=True)
    for gamma in (1, 4):
        ours = speculative_generate(
            target, drafter, ragged_prompts, gamma=gamma, max_new_tokens=16, eos_token_ids=[], static=True
        )
        assert ours.sequences == alone.sequences
        assert 0 < ours.stats.accepted < ours.stats.drafted


# --- sampling: the static core's samples follow the target (the G-test of tests/test_verify.py) ----


def static_joint(target, drafter, params: SamplingParams, seed: int, lookup=None) -> torch.Tensor:
    result = speculative_generate(
        target,
        drafter,
        [PROMPT] * N_SAMPLES,
        gamma=3,
        max_new_tokens=N_TOKENS,
        temperature=params.temperature,
        top_k=params.top_k,
        eos_token_ids=[],
        seed=seed,
        prompt_lookup=lookup,
        static=True,
    )
    assert result.stats.accepted > 0
    return joint_counts(result.sequences)


def test_static_samples_follow_the_target(mc_models) -> None:
    """A feature drafter with most drafts looked up (the slice drafter's path: the planted-bug test
    below, which must fail the same test)."""
    target, _ = mc_models
    params = SamplingParams(0.7, top_k=3)
    observed = static_joint(target, mc_feature_drafter(target), params, seed=0, lookup=EAGER_LOOKUP)
    assert g_test_pvalue(observed, exact_joint(target, params)) > SIGNIFICANCE


def test_static_distribution_test_catches_resampling_from_p(mc_models, monkeypatch) -> None:
    """Planted bug in the static core: at a rejection, resample from p instead of norm(max(0, p - q)).
    (Its extra draw comes from a generator of its own: the round's own draws are made ahead, as many
    as a correct round uses.)"""
    extra = torch.Generator().manual_seed(1)

    def buggy(draft_tokens, q, p, generator=None, greedy=False):
        num_accepted, _ = rejection_sample(draft_tokens, q, p, generator, greedy)
        at_n = num_accepted.view(-1, 1, 1).expand(-1, 1, p.shape[-1])
        return num_accepted, sample(p.gather(1, at_n).squeeze(1), extra)

    monkeypatch.setattr(specdecode.decoding.verify, "rejection_sample", buggy)
    target, drafter = mc_models
    params = SamplingParams(1.0)
    assert g_test_pvalue(static_joint(target, drafter, params, seed=0), exact_joint(target, params)) < SIGNIFICANCE


# --- bad options ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, needle",
    [
        (dict(static="yes"), TypeError, "static must be true or false, got 'yes'"),
        (dict(static=True, compile="auto"), TypeError, "compile must be true, false or null .*'auto'"),
        (dict(compile=True), ValueError, "compile=True needs static=True"),
        (dict(capacity=64), ValueError, "capacity=64 needs static=True"),
        (dict(static=True, capacity=7), ValueError, r"capacity must be an int of at least (11|8) cache .*got 7"),
        (dict(static=True, capacity=True), TypeError, "capacity must be a positive int .*got True"),
        (dict(static=True, capacity="x", max_new_tokens=0), TypeError, "capacity must be a positive int .*got 'x'"),
        (dict(static=True, capacity=2, max_new_tokens=0), ValueError, "capacity must be an int of at least (7|4) "),
    ],
)
def test_bad_core_options_are_named_before_any_work(target, kwargs, error, needle) -> None:
    calls: list[int] = []
    handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(error, match=needle):
            speculative_generate(
                target, tiny_llama(1, seed=1), [[1, 2, 3]], **(dict(gamma=2, max_new_tokens=4) | kwargs)
            )
        with pytest.raises(error, match=needle):
            autoregressive_generate(target, [[1, 2, 3]], **(dict(max_new_tokens=4) | kwargs))
    finally:
        handle.remove()
    assert calls == []


# --- a fixed capacity ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["slice", "feature", "target alone"])
def test_a_fixed_capacity_sizes_every_cache_and_decodes_the_same_tokens(
    target, ragged_prompts, early_eos, monkeypatch, kind: str
) -> None:
    made = []
    for_model = StaticKVCache.for_model.__func__
    monkeypatch.setattr(
        StaticKVCache,
        "for_model",
        classmethod(lambda cls, m, b, c, *rest: made.append(c) or for_model(cls, m, b, c, *rest)),
    )
    kwargs = dict(max_new_tokens=BUDGETS, eos_token_ids=[early_eos], static=True)
    if kind == "target alone":
        run = lambda **more: autoregressive_generate(target, ragged_prompts, feature_layers=(-1,), **kwargs, **more)  # noqa: E731
    else:
        drafter = drafter_of(kind, target)
        run = lambda **more: speculative_generate(target, drafter, ragged_prompts, gamma=3, **kwargs, **more)  # noqa: E731
    default = run()
    assert set(made) == {64}  # 12 + 20 + slack, rounded up to a power of two
    made.clear()
    fixed = run(capacity=100)
    assert set(made) == {100} and fixed.sequences == default.sequences and counters(fixed) == counters(default)
    if kind == "target alone":
        assert all(torch.equal(a, b) for a, b in zip(fixed.features, default.features))


# --- compiled steps (slow: inductor compiles each shape for seconds on a CPU) ---------------------


@pytest.mark.parametrize("temperature, seed", [(0.0, 3), (0.7, None), (0.7, 3)], ids=["greedy", "sampled", "seeded"])
@pytest.mark.parametrize("who", ["round", "target alone"])
def test_rounds_and_steps_compile_whole_a_seeded_generator_drawing_ahead(
    target, monkeypatch, who: str, temperature: float, seed: int | None
) -> None:
    """What `compile` compiles, with the compiling itself stubbed out (the slow tests compile): the
    whole round (step), even where a seeded generator samples. Its draws are made before each
    round (step), the same numbers as without compiling."""
    functions = []
    monkeypatch.setattr(specdecode.decoding.compiled, "compiled_function", lambda f, d: functions.append(f) or f)
    kwargs = dict(max_new_tokens=6, eos_token_ids=[], temperature=temperature, seed=seed)
    if who == "round":
        kwargs.update(gamma=2, drafter=derive_drafter(target, 1))
    run = speculative_generate if who == "round" else autoregressive_generate
    ours = run(target, prompts=[[1, 2, 3], [4]], static=True, compile=True, **kwargs)
    if seed is not None:
        assert ours.sequences == run(target, prompts=[[1, 2, 3], [4]], static=True, **kwargs).sequences
    assert [len(s) for s in ours.sequences] == [6, 6]
    assert functions == [specdecode.decoding.static._round if who == "round" else specdecode.decoding.static._step]


@pytest.mark.parametrize("kind", ["slice", "feature"])
def test_seeded_rounds_draw_ahead_what_the_eager_loop_draws(target, kind: str) -> None:
    """A static round samples against its draws made ahead (`DrawnAhead`: the drafts' races, the
    acceptance uniforms, the resample's race), which a compiled round needs: with one row, the
    eager loop's seeded samples, token for token."""
    kwargs = dict(gamma=3, max_new_tokens=16, eos_token_ids=[], temperature=0.8, seed=7, prompt_lookup=None)
    drafter = drafter_of(kind, target)
    eager = speculative_generate(target, drafter, [[1, 2, 3]], **kwargs)
    assert speculative_generate(target, drafter, [[1, 2, 3]], static=True, **kwargs).sequences == eager.sequences
    assert eager.sequences != speculative_generate(target, drafter, [[1, 2, 3]], **{**kwargs, "seed": 8}).sequences


def test_state_a_compiled_step_reassigns_is_copied_out_before_the_next(target, monkeypatch) -> None:
    """As for a round (below): a whole compiled step of the target alone reassigns the rows' and
    the cache's lengths and the active rows; each must be a copy by the next step."""
    held: dict[str, torch.Tensor] = {}
    checked: list[str] = []

    def named(rows, cache) -> dict[str, torch.Tensor]:
        return {"rows.lengths": rows.lengths, "rows.active": rows.active, "cache.lengths": cache.lengths}

    def watched(target, rows, cache, *args):
        for key, value in named(rows, cache).items():
            if key in held:
                checked.append(key)
                assert value is not held[key], f"{key} is still the tensor the last step returned"
        specdecode.decoding.static._step(target, rows, cache, *args)
        held.clear()
        held.update(named(rows, cache))

    monkeypatch.setattr(specdecode.decoding.compiled, "compiled_function", lambda f, d: watched)
    result = autoregressive_generate(
        target,
        [[1, 2, 3], [4, 5]],
        max_new_tokens=[6, 3],
        eos_token_ids=[],
        static=True,
        compile=True,
        feature_layers=(-1,),
    )
    assert [len(s) for s in result.sequences] == [6, 3]
    assert set(checked) == {"rows.lengths", "rows.active", "cache.lengths"}


@pytest.mark.parametrize("seed", [None, 3], ids=["unseeded", "seeded"])
def test_compiled_steps_skip_guards_from_the_third(target, monkeypatch, seed) -> None:
    """The first `GUARDED_STEPS` compiled rounds (steps) of a call evaluate their guards, and so
    compile what the call needs; later ones skip them."""
    flags: list[bool] = []
    monkeypatch.setattr(specdecode.decoding.compiled, "compiled_function", lambda f, d: f)
    monkeypatch.setattr(
        specdecode.decoding.static, "skipped_guards", lambda skip: flags.append(skip) or contextlib.nullcontext()
    )
    kwargs = dict(max_new_tokens=6, eos_token_ids=[], temperature=0.7, seed=seed, static=True, compile=True)
    torch.manual_seed(0)  # unseeded calls draw from the global generator: fix how many rounds they take
    speculative_generate(target, derive_drafter(target, 1), [[1, 2, 3]], gamma=2, **kwargs)
    rounds, flags[:] = list(flags), []
    autoregressive_generate(target, [[1, 2, 3]], **kwargs)
    assert rounds == [False, False] + [True] * (len(rounds) - 2) and len(rounds) >= 3
    assert flags == [False, False] + [True] * 3


def test_skipped_guards_take_the_public_stance_api(monkeypatch) -> None:
    """Skipping guards is `torch.compiler.set_stance`'s `skip_guard_eval_unsafe` (no private state
    read); without `skip` the caller's stance is left as it is."""
    calls: list[tuple[tuple, dict]] = []
    monkeypatch.setattr(torch.compiler, "set_stance", lambda *a, **k: calls.append((a, k)) or contextlib.nullcontext())
    with specdecode.decoding.compiled.skipped_guards(False):
        assert calls == []
    with specdecode.decoding.compiled.skipped_guards(True):
        assert calls == [(("default",), {"skip_guard_eval_unsafe": True})]


def test_the_feature_drafters_cache_is_allocated_in_its_prefill_even_for_one_token_prompts(target) -> None:
    """The drafter's static cache allocates its buffers at its first pass. That must be the prefill,
    which runs eagerly: inside a compiled round, marking them static cannot be traced."""
    drafter = random_feature_drafter(target, feature_layers=(1, -1))
    drafting = specdecode.decoding.drafting.drafting_for(drafter, StaticKVCache.for_model(drafter, 2, 16))
    capacity = specdecode.decoding.static_cache.rows_capacity([[5], [9]], [4, 4], 2)
    rows = specdecode.decoding.rows.StaticRows([[5], [9]], [4, 4], capacity, eos=[], device=target.device)
    cache = StaticKVCache.for_model(target, 2, rows.capacity)
    _, hidden = specdecode.decoding.rows.prefill(target, cache, rows, drafting.feature_layers)
    drafting.prefill(rows.tokens, rows.lengths, 1, hidden)
    assert all(keys is not None for keys in drafting.cache.keys)
    assert drafting.start.tolist() == [0, 0] and drafting.cache.lengths.tolist() == [0, 0]


def test_seeded_draws_made_ahead_are_the_eager_loops_own(target) -> None:
    """The static step samples against draws made before it (`sample_draws`), which a compiled
    step needs: with no row finishing early, the eager loop's seeded samples, token for token."""
    kwargs = dict(max_new_tokens=10, eos_token_ids=[], temperature=0.8, seed=7)
    prompts = [[1, 2, 3], [4, 5], [6]]
    eager = autoregressive_generate(target, prompts, **kwargs)
    assert autoregressive_generate(target, prompts, static=True, **kwargs).sequences == eager.sequences
    assert eager.sequences != autoregressive_generate(target, prompts, **{**kwargs, "seed": 8}).sequences


def test_seeded_drafts_are_drawn_over_the_logits_width_not_the_configs() -> None:
    """A slice drafter draws over its logits' width (its lm_head's rows), which a config may state
    otherwise: the draws made ahead must be as wide as the draws made in place."""
    target, drafter = tiny_llama(3, seed=0), derive_drafter(tiny_llama(3, seed=0), 1)
    target.config.vocab_size = drafter.config.vocab_size = V - 4  # both lm_heads keep V rows
    kwargs = dict(gamma=2, max_new_tokens=6, eos_token_ids=[], seed=7, temperature=0.8)
    eager = speculative_generate(target, drafter, [[1, 2, 3]], **kwargs)
    assert speculative_generate(target, drafter, [[1, 2, 3]], static=True, **kwargs).sequences == eager.sequences


# Tensors a round reassigns that the next round sets before it reads them: no copy needed.
REWRITTEN_FIRST = {"_write_slots", "active@lookup"}


@pytest.mark.parametrize("kind", ["slice", "feature"])
def test_state_a_compiled_round_reassigns_is_copied_out_before_the_next(target, monkeypatch, kind: str) -> None:
    """On CUDA a compiled round's outputs live in its CUDA graph's memory, overwritten by the next
    replay: every tensor the round reassigns, rather than writes in place, must be a copy by the next
    round (`torch.compile` stubbed out: this checks the loop's bookkeeping, not a GPU)."""
    held: dict[tuple[int, str], torch.Tensor] = {}
    checked: list[str] = []

    def tensors(*objects) -> dict[tuple[int, str], torch.Tensor]:
        found = {}
        for i, obj in enumerate(objects):
            for name, value in vars(obj).items():
                if isinstance(value, torch.Tensor):
                    key = f"{name}@lookup" if isinstance(obj, specdecode.decoding.lookup.ActiveRowsLookup) else name
                    found[(i, key)] = value
        return found

    def watched(target, drafting, rows, cache, counters, lookup, *args):
        objects = (rows, cache, drafting, drafting.cache, counters, lookup)
        for key, value in tensors(*objects).items():
            if key in held and key[1] not in REWRITTEN_FIRST:
                checked.append(key[1])
                assert value is not held[key], f"{key[1]} is still the tensor the last round returned"
        before = tensors(*objects)
        specdecode.decoding.static._round(target, drafting, rows, cache, counters, lookup, *args)
        held.clear()
        held.update({k: v for k, v in tensors(*objects).items() if before.get(k) is not v})

    monkeypatch.setattr(specdecode.decoding.compiled, "compiled_function", lambda f, d: watched)
    drafter = drafter_of(kind, target)
    speculative_generate(
        target, drafter, [[1, 2, 3], [4, 5]], gamma=3, max_new_tokens=12, eos_token_ids=[], static=True, compile=True
    )
    expected = {"lengths", "active"} | ({"start"} if kind == "feature" else set())
    assert expected <= set(checked)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["slice", "feature"])
def test_compiled_greedy_equals_the_eager_loop_and_compiles_once(target, ragged_prompts, early_eos, kind) -> None:
    """Compiled steps: the eager loop's tokens at gamma 1 and 4 and target alone; a second call of
    the same shapes compiles nothing (`fail_on_recompile`)."""
    drafter = drafter_of(kind, target)
    for gamma in (1, 4):
        kwargs = dict(gamma=gamma, max_new_tokens=BUDGETS, eos_token_ids=[early_eos])
        eager = speculative_generate(target, drafter, ragged_prompts, **kwargs)
        ours = speculative_generate(target, drafter, ragged_prompts, static=True, compile=True, **kwargs)
        assert ours.sequences == eager.sequences and counters(ours) == counters(eager)
        with torch.compiler.set_stance("fail_on_recompile"):
            again = speculative_generate(target, drafter, ragged_prompts, static=True, compile=True, **kwargs)
        assert again.sequences == eager.sequences
    alone = dict(max_new_tokens=BUDGETS, eos_token_ids=[early_eos], feature_layers=(0, -1))
    eager = autoregressive_generate(target, ragged_prompts, **alone)
    ours = autoregressive_generate(target, ragged_prompts, static=True, compile=True, **alone)
    assert ours.sequences == eager.sequences
    for a, b in zip(ours.features, eager.features):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_calls_of_one_capacity_share_compiled_graphs(target) -> None:
    """Prompts of other lengths and budgets, one capacity: the second call compiles nothing."""
    kwargs = dict(eos_token_ids=[], static=True, compile=True, capacity=48)
    first = autoregressive_generate(target, [[1, 2, 3], [4]], max_new_tokens=5, **kwargs)
    with torch.compiler.set_stance("fail_on_recompile"):
        again = autoregressive_generate(target, [[5, 6, 7, 8, 9, 10, 11], [12, 13]], max_new_tokens=[30, 2], **kwargs)
    assert [len(s) for s in first.sequences] == [5, 5] and [len(s) for s in again.sequences] == [30, 2]
    assert (
        again.sequences
        == autoregressive_generate(
            target, [[5, 6, 7, 8, 9, 10, 11], [12, 13]], max_new_tokens=[30, 2], eos_token_ids=[]
        ).sequences
    )


@pytest.mark.parametrize("who", ["target alone", pytest.param("round", marks=pytest.mark.slow)])
def test_one_compiled_graph_samples_at_every_temperature(target, who: str) -> None:
    """The temperature reaches a compiled step or round as a tensor (`TensorTemperature`): a second
    temperature compiles nothing, and seeded steps draw what the eager loop draws at each."""
    kwargs = dict(max_new_tokens=8, eos_token_ids=[], seed=3, capacity=32, static=True)
    if who == "round":
        # prompt lookup off: by default it applies up to 0.7 only, and on or off is its own graph
        kwargs.update(gamma=2, drafter=drafter_of("feature", target), prompt_lookup=None)
    run = speculative_generate if who == "round" else autoregressive_generate
    for i, temperature in enumerate((0.7, 1.3)):
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            ours = run(target, prompts=[[1, 2, 3]], temperature=temperature, compile=True, **kwargs)
        eager = run(target, prompts=[[1, 2, 3]], temperature=temperature, **kwargs)
        assert ours.sequences == eager.sequences


@pytest.mark.slow
def test_compiled_rounds_with_one_token_prompts_equal_the_eager_loop(target) -> None:
    """Every prompt one token long: the feature drafter's prefill reads no position, yet the first
    (compiled) round must find its cache allocated."""
    drafter = drafter_of("feature", target)
    kwargs = dict(gamma=3, max_new_tokens=8, eos_token_ids=[])
    eager = speculative_generate(target, drafter, [[5], [9]], **kwargs)
    assert speculative_generate(target, drafter, [[5], [9]], static=True, compile=True, **kwargs).sequences == (
        eager.sequences
    )


@pytest.mark.slow
def test_compiled_seeded_steps_draw_what_the_eager_loop_draws(target) -> None:
    kwargs = dict(max_new_tokens=10, eos_token_ids=[], temperature=0.8, seed=7)
    prompts = [[1, 2, 3], [4, 5], [6]]
    eager = autoregressive_generate(target, prompts, **kwargs)
    assert autoregressive_generate(target, prompts, static=True, compile=True, **kwargs).sequences == eager.sequences


@pytest.mark.slow
@pytest.mark.parametrize("seed", [5, None], ids=["seeded: draws made ahead", "unseeded: inductor's draws"])
def test_compiled_samples_follow_the_target(mc_models, seed: int | None) -> None:
    """Each round is one compiled graph: seeded, it samples against its generator's draws made
    ahead (dynamo cannot trace a generator); unseeded, against inductor's own random numbers."""
    target, _ = mc_models
    params = SamplingParams(1.0)
    torch.manual_seed(5)
    result = speculative_generate(
        target,
        mc_feature_drafter(target),
        [PROMPT] * N_SAMPLES,
        gamma=3,
        max_new_tokens=N_TOKENS,
        temperature=1.0,
        eos_token_ids=[],
        seed=seed,
        static=True,
        compile=True,
    )
    assert result.stats.accepted > 0
    assert g_test_pvalue(joint_counts(result.sequences), exact_joint(target, params)) > SIGNIFICANCE
