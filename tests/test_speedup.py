"""The speedup model and the step-cost measurement."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specdecode.decoding.speedup import StepCosts, expected_tokens_per_step, measure_step_costs, predicted_speedup
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
    from specdecode.decoding import speedup

    timed_gammas = []

    def verify(target, context, gammas, repeats):
        assert len(context) > max(gammas) + 1
        timed_gammas.append(list(gammas))
        return {g: 1.0 + 0.1 * g for g in gammas}

    def step(target, drafter, context, gamma, repeats):
        return StepCosts(0.1, 0.1, drafter.seconds, gamma, len(context))

    monkeypatch.setattr(speedup, "measure_verify_ratios", verify)
    monkeypatch.setattr(speedup, "measure_step_costs", step)
    drafters = {"a": SimpleNamespace(seconds=0.01), "b": SimpleNamespace(seconds=0.02), "c": SimpleNamespace(seconds=0.01)}
    costs = speedup.measure_pass_costs(None, drafters, {"a": 3, "b": 3, "c": 1}, [5, 6], repeats=2)
    assert timed_gammas == [[1, 3]]
    assert costs == pytest.approx({"a": 1.3 + 3 * 0.1, "b": 1.3 + 3 * 0.2, "c": 1.1 + 0.1})
    timed_gammas.clear()
    with pytest.raises(ValueError, match=r"none for \['b'\]"):
        speedup.measure_pass_costs(None, drafters, {"a": 3, "c": 1}, [5, 6])
    with pytest.raises(ValueError, match="drafters=\\[\\]"):
        speedup.measure_pass_costs(None, {}, {"a": 3}, [5, 6])
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
    assert speculative_generate(target, drafter, [[1, 2, 3]], gamma=5, max_new_tokens=8, eos_token_ids=[]).stats.gamma == 5


def test_verify_widths_take_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each repeat times every width once, in turn, so drift on a shared machine biases all alike."""
    from specdecode.decoding import speedup

    widths: list[int] = []
    real = speedup.cached_forward

    def recording(model, cache, input_ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        widths.append(input_ids.shape[1])
        return real(model, cache, input_ids, *args, **kwargs)

    monkeypatch.setattr(speedup, "cached_forward", recording)
    ratios = speedup.measure_verify_ratios(tiny_llama(1, seed=0), list(range(20)), [1, 3], repeats=2)
    assert set(ratios) == {1, 3} and all(r > 0 for r in ratios.values())
    # the cached context (20 - 4 tokens), then (1 warm-up + 2) rounds of widths 1, 2, 4
    assert widths == [16] + [1, 2, 4] * 3


@pytest.mark.parametrize("perfect", [True, False])
def test_choose_gamma_counts_tokens_per_pass_by_decoding(monkeypatch: pytest.MonkeyPatch, perfect: bool) -> None:
    """With prompts, gamma follows the tokens per pass that decoding counted, not Leviathan's model
    at the alpha it is given: a drafter that is the target itself gets the longest gamma even at
    alpha 0, a drafter that is never right gets 1; without prompts the model decides."""
    import copy

    from specdecode import speculative_generate
    from specdecode.decoding import speedup
    from specdecode.decoding.speedup import StepCosts, choose_gamma

    # fixed costs, so only the counted tokens per pass decide: c = 0.05, a flat verify (GPU-like)
    monkeypatch.setattr(speedup, "measure_step_costs", lambda *a, **k: StepCosts(1.0, 1.0, 0.05, 1, 20))
    monkeypatch.setattr(speedup, "measure_verify_ratios", lambda target, context, gammas, repeats: {g: 1.0 for g in gammas})
    target = tiny_llama(2, seed=0)
    drafter = copy.deepcopy(target) if perfect else tiny_llama(1, seed=1)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]
    figures = choose_gamma(target, drafter, list(range(20)), 0.0, [1, 2, 4, 8], prompts, max_new_tokens=24)
    assert figures["method"] == "measured tau" and set(figures["tau"]) == {1, 2, 4, 8}
    for gamma, tau in figures["tau"].items():
        counted = speculative_generate(target, drafter, prompts, gamma=gamma, max_new_tokens=24, eos_token_ids=[]).stats.tau
        assert tau == pytest.approx(counted)
        assert figures["predicted_speedups"][gamma] == pytest.approx(tau / (gamma * 0.05 + 1.0))
    assert figures["chosen"] == drafter.config.specdecode_gamma == (8 if perfect else 1)
    if perfect:
        assert figures["tau"][8] > 4 > figures["tau"][1]  # the drafts were accepted
        model = choose_gamma(target, drafter, list(range(20)), 0.0, [1, 2, 4, 8])
        assert model["method"] == "Leviathan's model at alpha" and model["chosen"] == 1
