"""The step costs of each decode core (`timing.core_step_costs`): every core times the same target step, verify
and drafts, from the same state each time, on a tiny random target."""

from __future__ import annotations

import pytest
import torch

import specdecode.decoding.timing
import specdecode.evaluation.benchmark
from specdecode import autoregressive_generate
from specdecode.decoding.attention import folded_gqa
from specdecode.decoding.costs import step_pieces
from specdecode.decoding.static_cache import StaticKVCache
from specdecode.decoding.timing import core_step_costs
from specdecode.evaluation.benchmark import run_core_benchmark
from specdecode.evaluation.benchmark_report import costs_markdown
from specdecode.models import derive_drafter
from tests.models_for_tests import tiny_llama
from tests.test_feature_drafter import random_feature_drafter

PROMPT = [3, 9, 17, 4, 22, 8, 31, 5, 12]


def _outputs(target, drafter, core: str, length: int, gamma: int) -> dict[str, list[list[int]]]:
    """Each piece of `core`, run twice from its state put back: its outputs."""
    tokens = torch.tensor([(PROMPT * 8)[:64]])
    with torch.inference_mode(), folded_gqa(target, drafter):
        pieces = step_pieces(target, drafter, tokens, length, [gamma], core=core, step_capacity=32)
        found = {}
        for (name, _), (back, run) in pieces.items():
            found[name] = []
            for _ in range(2):
                back()
                found[name].append(run().tolist())
    return found


@pytest.mark.parametrize("kind", ["slice", "feature"])
def test_every_core_times_the_same_step_verify_and_drafts_each_time(kind: str) -> None:
    target = tiny_llama(2, seed=0)
    drafter = derive_drafter(target, 1) if kind == "slice" else random_feature_drafter(target)
    length, gamma = 20, 3
    eager = _outputs(target, drafter, "eager", length, gamma)
    assert _outputs(target, drafter, "static", length, gamma) == eager
    for name, (first, again) in eager.items():
        assert first == again, f"{name} ran from another state the second time"
    context = [(PROMPT * 8)[:length]]
    next_token = autoregressive_generate(target, context, max_new_tokens=1, eos_token_ids=[]).sequences[0]
    assert eager["step"][0] == [next_token]
    assert eager["verify"][0][0][0] == next_token[0]  # an accepted first draft is the target's token too
    if kind == "slice":  # greedy drafts: the drafter's own greedy continuation
        drafts = autoregressive_generate(drafter, context, max_new_tokens=gamma, eos_token_ids=[]).sequences[0]
        assert eager["draft"][0] == [drafts]


def test_step_costs_are_reported_per_core(monkeypatch) -> None:
    timed = {}

    def fake_times(pieces, repeats, compiled, device, models):
        timed.update({key: 0.001 * (i + 1) for i, key in enumerate(pieces)})
        return timed

    monkeypatch.setattr(specdecode.decoding.timing, "_time_pieces", fake_times)
    target = tiny_llama(2, seed=0)
    costs = core_step_costs(target, derive_drafter(target, 1), PROMPT, new_tokens=8, gamma=2, cores=("eager", "static"))
    assert list(costs) == ["eager", "static"]
    for core, c in costs.items():
        assert (c.target_step_s, c.target_verify_s) == (timed[core, "step"], timed[core, "verify"])
        assert c.drafter_step_s == timed[core, "draft"] / 2  # a draft piece drafts gamma tokens
        assert (c.gamma, c.context_tokens) == (2, len(PROMPT) + 4)
    table = costs_markdown({"slice": costs})
    assert "| slice | static | 4.00 | 5.00 | 3.00 | 0.750 | 1.25 |" in table


@pytest.mark.parametrize("kind", ["slice", "feature"])
def test_the_static_cores_time_on_static_caches_as_large_as_their_decodes(monkeypatch, kind: str) -> None:
    """A decode of 20 tokens after 9 at gamma 4 gets 64 slots (9 + 20 + 4 + 2 rounded up), the
    target alone 32 (9 + 20 + 1); the eager core's caches are ragged."""
    target = tiny_llama(2, seed=0)
    drafter = derive_drafter(target, 1) if kind == "slice" else random_feature_drafter(target)
    made = []
    static_for_model = StaticKVCache.for_model.__func__

    def recording(cls, model, batch_size, capacity, *zeros):
        made.append(("target" if model is target else "drafter", capacity))
        return static_for_model(cls, model, batch_size, capacity, *zeros)

    monkeypatch.setattr(StaticKVCache, "for_model", classmethod(recording))
    monkeypatch.setattr(specdecode.decoding.timing, "_time_pieces", lambda pieces, *args: dict.fromkeys(pieces, 1.0))
    core_step_costs(target, drafter, PROMPT, new_tokens=20, gamma=4, cores=("eager",))
    assert made == []
    core_step_costs(target, drafter, PROMPT, new_tokens=20, gamma=4, cores=("static",))
    assert sorted(made) == [("drafter", 64), ("target", 32), ("target", 64)]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(cores=("eager", "compild")), "compild"),
        (dict(cores=()), "cores must be"),
        (dict(gamma=0), "gamma must be an int >= 1, got 0"),
        (dict(new_tokens=True), "new_tokens must be an int >= 1, got True"),
        (dict(repeats=0), "repeats must be"),
        (dict(prompt=[]), "prompt must hold"),
    ],
)
def test_bad_arguments_are_named_before_any_work(kwargs: dict, needle: str) -> None:
    target = tiny_llama(2, seed=0)
    arguments = dict(prompt=PROMPT, new_tokens=8, gamma=2) | kwargs
    with pytest.raises(ValueError, match=needle):
        core_step_costs(target, derive_drafter(target, 1), **arguments)


def test_the_benchmark_prints_each_drafters_step_costs(monkeypatch) -> None:
    def eager_and_static(*args, **kwargs):
        return core_step_costs(*args, **kwargs, cores=("eager", "static"), repeats=1)

    monkeypatch.setattr(specdecode.evaluation.benchmark, "core_step_costs", eager_and_static)
    lines: list[str] = []
    run_core_benchmark(
        "tiny", "cpu", dtypes=("float32",), batch_sizes=(1,), gamma=2, new_tokens=4, prompts_at_batch_1=1,
        rounds=1, writer_batch=0, only=("target alone, eager",), progress=lines.append, step_costs=True,
    )  # fmt: skip
    table = next(line for line in lines if line.startswith("step costs at gamma 2"))
    assert all(f"| {kind} | {core} |" in table for kind in ("slice", "feature") for core in ("eager", "static"))


@pytest.mark.slow  # compiles three graphs per drafter (about a minute on a CPU)
@pytest.mark.parametrize("kind", ["slice", "feature"])
def test_the_compiled_core_times_the_same_work(kind: str) -> None:
    target = tiny_llama(2, seed=0)
    drafter = derive_drafter(target, 1) if kind == "slice" else random_feature_drafter(target)
    assert _outputs(target, drafter, "compiled", 20, 3) == _outputs(target, drafter, "eager", 20, 3)
