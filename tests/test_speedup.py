"""The speedup model (speedup.py), the timing harness (timing.py) and the gamma choice (gamma.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from specdecode.decoding.speedup import expected_tokens_per_step, predicted_speedup
from specdecode.decoding.timing import StepCosts, measure_step_costs
from tests.models_for_tests import tiny_llama


def test_expected_tokens_per_step_limits() -> None:
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    # Geometric sum 1 + a + a^2 for gamma = 2.
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)


def test_predicted_speedup_matches_leviathan_when_verify_is_free() -> None:
    # Leviathan et al. Thm 3.8: (1 - a^(g+1)) / ((1 - a)(g c + 1)).
    alpha, gamma, c = 0.8, 4, 0.1
    paper = (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))
    assert predicted_speedup(alpha, gamma, c, verify_ratio=1.0) == pytest.approx(paper)
    # A dearer verify pass can only lower the prediction.
    assert predicted_speedup(alpha, gamma, c, verify_ratio=1.45) < paper


def test_notes_figures() -> None:
    """NOTES.md: with c = 0.1 and the CPU's verify cost, alpha 0.8 gives about 1.8x at gamma 4."""
    assert predicted_speedup(0.8, 4, 0.1, verify_ratio=85 / 59) == pytest.approx(1.8, abs=0.05)


def test_bad_alpha_is_named() -> None:
    with pytest.raises(ValueError, match="1.5"):
        expected_tokens_per_step(1.5, 3)


def test_measure_step_costs_reports_positive_times() -> None:
    target, drafter = tiny_llama(2, seed=0), tiny_llama(1, seed=1)
    costs = measure_step_costs(target, drafter, list(range(20)), gamma=3, repeats=3)
    assert costs.target_step_s > 0 and costs.target_verify_s > 0 and costs.drafter_step_s > 0
    assert costs.cost_ratio == costs.drafter_step_s / costs.target_step_s
    with pytest.raises(ValueError, match="gamma"):
        measure_step_costs(target, drafter, [1, 2, 3], gamma=3)


def test_pass_costs_are_a_verify_plus_gamma_drafter_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each gamma's verify is timed once and shared; each drafter adds gamma of its own steps. A
    context shorter than the longest verify is repeated, not refused."""
    from specdecode.decoding import timing

    timed_gammas = []

    def verify(target, context, gammas, repeats):
        assert len(context) > max(gammas) + 1
        timed_gammas.append(list(gammas))
        return {g: 1.0 + 0.1 * g for g in gammas}

    def step(target, drafter, context, gamma, repeats):
        return StepCosts(0.1, 0.1, drafter.seconds, gamma, len(context))

    monkeypatch.setattr(timing, "measure_verify_ratios", verify)
    monkeypatch.setattr(timing, "measure_step_costs", step)
    drafters = {
        "a": SimpleNamespace(seconds=0.01),
        "b": SimpleNamespace(seconds=0.02),
        "c": SimpleNamespace(seconds=0.01),
    }
    costs = timing.measure_pass_costs(None, drafters, {"a": 3, "b": 3, "c": 1}, [5, 6], repeats=2)
    assert timed_gammas == [[1, 3]]
    assert costs == pytest.approx({"a": 1.3 + 3 * 0.1, "b": 1.3 + 3 * 0.2, "c": 1.1 + 0.1})
    timed_gammas.clear()
    with pytest.raises(ValueError, match=r"none for \['b'\]"):
        timing.measure_pass_costs(None, drafters, {"a": 3, "c": 1}, [5, 6])
    with pytest.raises(ValueError, match="drafters=\\[\\]"):
        timing.measure_pass_costs(None, {}, {"a": 3}, [5, 6])
    assert timed_gammas == []  # refused before any timing


def test_optimal_gamma_follows_acceptance_and_verify_cost() -> None:
    from specdecode.decoding.speedup import optimal_gamma

    flat = {g: 1.0 for g in range(1, 9)}  # a GPU-like verify: gamma + 1 tokens cost one step
    low, low_speedup = optimal_gamma(0.05, 0.1, flat)
    high, high_speedup = optimal_gamma(0.9, 0.02, flat)
    assert low == 1 and low_speedup < 1.0  # a drafter that is never right does not pay
    assert high >= 6 and high_speedup > 3.0
    # a verify that costs more with every token pulls the optimum down
    steep = {g: 1.0 + 0.5 * g for g in range(1, 9)}
    assert optimal_gamma(0.9, 0.02, steep)[0] < high
    with pytest.raises(ValueError, match="verify_ratios is empty"):
        optimal_gamma(0.5, 0.1, {})


def test_speculative_generate_uses_the_drafters_stored_gamma() -> None:
    from specdecode import speculative_generate
    from specdecode.decoding.decode import DEFAULT_GAMMA, drafter_gamma
    from tests.models_for_tests import tiny_llama

    target, drafter = tiny_llama(2, seed=0), tiny_llama(1, seed=1)
    assert drafter_gamma(drafter) == DEFAULT_GAMMA
    drafter.config.specdecode_gamma = 2
    result = speculative_generate(target, drafter, [[1, 2, 3]], max_new_tokens=8, eos_token_ids=[])
    assert result.stats.gamma == 2
    assert (
        speculative_generate(target, drafter, [[1, 2, 3]], gamma=5, max_new_tokens=8, eos_token_ids=[]).stats.gamma == 5
    )


def test_verify_widths_take_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each repeat times every width once, in turn, so drift on a shared machine biases all alike."""
    from specdecode.decoding import costs, timing, verify

    widths: list[int] = []
    real = costs.cached_forward_features

    def recording(model, cache, input_ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        widths.append(input_ids.shape[1])
        return real(model, cache, input_ids, *args, **kwargs)

    for module in (costs, verify):  # the pieces' passes: the prefill and the step, the verifies
        monkeypatch.setattr(module, "cached_forward_features", recording)
    ratios = timing.measure_verify_ratios(tiny_llama(1, seed=0), list(range(20)), [1, 3], repeats=2)
    assert set(ratios) == {1, 3} and all(r > 0 for r in ratios.values())
    # the cached context (20 - 4 tokens), then (1 warm-up + 2) rounds of widths 1, 2, 4
    assert widths == [16] + [1, 2, 4] * 3


class FakeClock:
    """`time.perf_counter` for the timed decodes: each decode advances it by its target passes times
    a pass's cost (1 for the target alone, `costs[gamma]` for a speculative one), so what the gamma
    choice measures is fixed by the test, not by the machine."""

    def __init__(self, costs: dict[int, float]) -> None:
        self.now, self.costs = 0.0, costs

    def perf_counter(self) -> float:
        return self.now

    def wrap(self, generate, cost_of):  # type: ignore[no-untyped-def]
        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            result = generate(*args, **kwargs)
            self.now += result.stats.target_calls * cost_of(kwargs)
            return result

        return timed


@pytest.mark.parametrize("perfect", [True, False])
def test_choose_gamma_keeps_the_fastest_timed_decode(monkeypatch: pytest.MonkeyPatch, perfect: bool) -> None:
    """With prompts, gamma is the one whose batch-1 decodes took least time beside the target alone's,
    tokens per pass counted on the same decodes: a drafter that is the target itself gets the longest
    gamma (at alpha 0, where Leviathan's model picks 1), unless its verify is dear enough to lose
    that; a drafter that is never right gets 1."""
    import copy

    from specdecode.decoding import decode, timing
    from specdecode.decoding.gamma import choose_gamma

    target = tiny_llama(2, seed=0)
    drafter = copy.deepcopy(target) if perfect else tiny_llama(1, seed=1)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]
    counted = {
        g: [
            decode.speculative_generate(
                target, drafter, [p], gamma=g, max_new_tokens=24, eos_token_ids=[]
            ).stats.target_calls
            for p in prompts
        ]
        for g in (1, 2, 4, 8)
    }

    def choose(costs: dict[int, float]) -> dict[str, Any]:
        clock = FakeClock(costs)
        with monkeypatch.context() as patch:
            patch.setattr(timing, "time", clock)
            patch.setattr(
                timing, "speculative_generate", clock.wrap(decode.speculative_generate, lambda kw: costs[kw["gamma"]])
            )
            patch.setattr(timing, "autoregressive_generate", clock.wrap(decode.autoregressive_generate, lambda kw: 1.0))
            return choose_gamma(target, drafter, list(range(20)), 0.0, [1, 2, 4, 8], prompts, max_new_tokens=24)

    flat = {g: 1.0 + 0.05 * g for g in (1, 2, 4, 8)}  # c = 0.05, a flat verify (GPU-like)
    figures = choose(flat)
    assert (
        figures["method"] == "timed decodes" and figures["autoregressive_seconds"] == 48
    )  # 24 passes each (the prefill, then 23 steps)
    for gamma, calls in counted.items():
        assert figures["tau"][gamma] == pytest.approx(48 / sum(calls))
        assert figures["seconds"][gamma] == pytest.approx(sum(calls) * flat[gamma])
        assert figures["measured_speedups"][gamma] == pytest.approx(
            figures["autoregressive_seconds"] / figures["seconds"][gamma]
        )
    assert figures["chosen"] == (8 if perfect else 1)
    assert getattr(drafter.config, "specdecode_gamma", None) is None  # the choice is returned, not stored
    assert figures["speedup"] == max(figures["measured_speedups"].values())
    if perfect:
        assert figures["tau"][8] > 4 > figures["tau"][1]  # the drafts were accepted
        # the same counted tokens, a 9-token verify three times a step: the time, not tau, decides
        dear = choose(flat | {8: 3.0})
        assert dear["tau"] == figures["tau"] and dear["chosen"] == 4
        # without prompts, Leviathan's model on step costs (fixed here: timed ones on a loaded
        # machine can measure a wider verify cheaper than a narrower one)
        from specdecode.decoding import gamma as gamma_choice

        costs = timing.StepCosts(1.0, 1.2, 0.05, 1, 20)
        monkeypatch.setattr(gamma_choice, "measure_step_costs", lambda *args, **kwargs: costs)
        monkeypatch.setattr(gamma_choice, "measure_verify_ratios", lambda *a, **kw: {g: 1 + 0.1 * g for g in a[2]})
        model = choose_gamma(target, drafter, list(range(20)), 0.0, [1, 2, 4, 8])
        assert model["method"] == "Leviathan's model at alpha" and model["chosen"] == 1


def test_timed_decodes_rotate_the_order_per_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prompt runs the target alone and each gamma back to back, the order rotated by one per
    prompt (drift on a shared machine biases none of them), after one untimed warm-up of each; every
    decode is batch 1 with the same fixed budget, temperature and seed."""
    from specdecode.decoding import decode, timing
    from specdecode.decoding.timing import timed_decodes

    calls: list[tuple[int, tuple[int, ...], int]] = []
    real_spec, real_ar = decode.speculative_generate, decode.autoregressive_generate

    def spec(target, drafter, prompts, **kw):  # type: ignore[no-untyped-def]
        calls.append((kw["gamma"], *map(tuple, prompts), kw["max_new_tokens"]))
        assert (kw["eos_token_ids"], kw["temperature"], kw["seed"]) == ([], 0.7, 0)
        return real_spec(target, drafter, prompts, **kw)

    def ar(target, prompts, **kw):  # type: ignore[no-untyped-def]
        calls.append((0, *map(tuple, prompts), kw["max_new_tokens"]))
        assert (kw["eos_token_ids"], kw["temperature"], kw["seed"]) == ([], 0.7, 0)
        return real_ar(target, prompts, **kw)

    monkeypatch.setattr(timing, "speculative_generate", spec)
    monkeypatch.setattr(timing, "autoregressive_generate", ar)
    target = tiny_llama(2, seed=0)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    timed = timed_decodes(target, tiny_llama(1, seed=1), prompts, [1, 3], max_new_tokens=12, temperature=0.7)
    assert calls[:3] == [(0, (1, 2, 3), 8), (1, (1, 2, 3), 8), (3, (1, 2, 3), 8)]  # warm-up: 2 gamma + 2 tokens
    assert [c[0] for c in calls[3:]] == [0, 1, 3, 1, 3, 0, 3, 0, 1]
    assert [c[1] for c in calls[3:]] == [tuple(p) for p in prompts for _ in range(3)] and {c[2] for c in calls[3:]} == {
        12
    }
    assert timed["tokens"] == 36 and set(timed["seconds"]) == set(timed["tau"]) == {1, 3}
    calls.clear()
    timed_decodes(target, tiny_llama(1, seed=1), prompts[:1], [3], max_new_tokens=5, temperature=0.7)
    assert [c[2] for c in calls] == [5, 5, 5, 5]  # a budget under 2 gamma + 2 warms up at the budget
    for bad, named in (
        ({"prompts": []}, "got 0 prompts"),
        ({"gammas": []}, r"gammas=\[\]"),
        ({"max_new_tokens": 1}, "max_new_tokens=1"),
    ):
        with pytest.raises(ValueError, match=named):
            timed_decodes(target, target, **({"prompts": prompts, "gammas": [1], "max_new_tokens": 4} | bad))


def test_within_noise_of_fastest_is_the_one_standard_error_rule() -> None:
    """A gamma stays a candidate while its mean per-prompt log time ratio to the fastest is within
    one standard error; a consistent lead, however small, excludes the slower."""
    from specdecode.decoding.gamma import within_noise_of_fastest

    noisy = {1: [1.0, 1.1, 0.9, 1.0], 3: [0.97, 1.16, 0.85, 0.99], 4: [1.05, 1.16, 0.95, 1.05]}
    # gamma 3 is fastest in total (3.97 s against 4.0 s); gamma 1's time ratios to it, 1.031 / 0.948 /
    # 1.059 / 1.010, average 0.0111 in log against a standard error of 0.0235; gamma 4's, 1.082 /
    # 1.0 / 1.118 / 1.061, average 0.0623 against 0.0234
    assert within_noise_of_fastest(noisy) == [1, 3]
    steady = {1: [1.03 * t for t in noisy[3]], 3: noisy[3]}  # 3% slower on every prompt: no noise at all
    assert within_noise_of_fastest(steady) == [3]
    assert within_noise_of_fastest({1: [1.0], 2: [0.99]}) == [2]  # one prompt: no error to measure
    assert within_noise_of_fastest({2: [1.0, 2.0], 4: [1.0, 2.0]}) == [2, 4]  # a tie in total goes to the shorter


def test_choose_gamma_takes_the_shortest_drafts_within_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chosen gamma is the shortest of those the timing cannot tell from the fastest, with the
    figures that chose it."""
    from specdecode.decoding import gamma

    timed = {
        "autoregressive_s": 8.0,
        "seconds": {1: 4.0, 3: 3.97, 4: 4.21},
        "tau": {1: 1.5, 3: 2.0, 4: 2.1},
        "per_prompt_s": {1: [1.0, 1.1, 0.9, 1.0], 3: [0.97, 1.16, 0.85, 0.99], 4: [1.05, 1.16, 0.95, 1.05]},
    }
    monkeypatch.setattr(gamma, "timed_decodes", lambda *a, **k: timed)
    drafter = tiny_llama(1, seed=1)
    figures = gamma.choose_gamma(tiny_llama(2, seed=0), drafter, [], 0.0, [1, 3, 4], [[1, 2, 3]], max_new_tokens=8)
    assert figures["within_noise_of_fastest"] == [1, 3] and figures["chosen"] == 1
    assert figures["speedup"] == pytest.approx(2.0) and figures["measured_speedups"][3] == pytest.approx(8.0 / 3.97)
