"""The per-token record of the decode loops (`specdecode.decoding.record`): its counts are the
loop's own stats, its tokens are the output, it adds no host sync, and routed rows name their drafter."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specdecode import autoregressive_generate, speculative_generate
from specdecode.decoding.lookup import PromptLookup
from specdecode.decoding.record import KINDS
from specdecode.models import derive_drafter, derive_feature_drafter
from specdecode.routing.generate import route_and_generate
from tests.models_for_tests import tiny_llama
from tests.stubs import MarkovLM, successor_table

V = 64
BUDGETS = [30, 5, 17, 0, 30, 22, 30, 9]
EOS = [52]  # greedy decoding of `target` below hits it in most rows, at different places
LOOKUP = PromptLookup(max_confidence=1.0)  # look up wherever a match exists, so lookups happen


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(2, seed=0)


def check_against_stats(result, gamma: int) -> Counter:
    """The record's counts are the stats' and its tokens the sequences; returns the kinds' counts."""
    record, stats = result.record, result.stats
    assert record is not None and len(record) == len(result.sequences)
    assert [[token for token, _ in row.tokens()] for row in record] == result.sequences
    steps = [step for row in record for step in row.steps[1:]]  # steps[0] is the prefill
    assert sum(row.accepted for row in record) == stats.accepted
    assert sum(row.drafted for row in record) == stats.drafted == gamma * len(steps)
    assert sum(row.generated for row in record) == stats.generated_tokens
    assert sum(row.generated for row in record) / sum(len(row.steps) for row in record) == pytest.approx(stats.tau)
    assert sum(sum(step.looked_up) for step in steps) == stats.looked_up
    assert Counter(step.accepted for step in steps) == {
        n: c for n, c in enumerate(stats.accepted_length_histogram) if c
    }
    for row in record:
        times = [step.time_s for step in row.steps]
        assert times == sorted(times) and all(t > 0 for t in times)
        for step in row.steps[1:]:
            # the target's token: a bonus after gamma accepted drafts, else it replaced a rejected draft
            assert step.target_kind == ("bonus" if step.accepted == gamma else "corrected")
            if step.accepted < gamma:
                assert step.target_token != step.drafted[step.accepted]
    return Counter(kind for row in record for _, kind in row.tokens())


@pytest.mark.parametrize("kind", ["derived", "feature"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_record_counts_equal_the_loops_stats(target, ragged_prompts, kind, temperature) -> None:
    drafter = derive_drafter(target, 1) if kind == "derived" else derive_feature_drafter(target, 1)
    result = speculative_generate(
        target,
        drafter,
        ragged_prompts,
        max_new_tokens=BUDGETS,
        gamma=3,
        temperature=temperature,
        seed=0,
        eos_token_ids=EOS,
        prompt_lookup=LOOKUP,
        record=True,
    )
    kinds = check_against_stats(result, gamma=3)
    assert set(kinds) <= set(KINDS) and kinds["target"] == sum(b > 0 for b in BUDGETS)
    assert kinds["corrected"] > 0 and kinds["accepted"] + kinds["looked_up"] > 0
    # rows that stopped early: at an EOS (kept, last) or at the budget
    assert any(s and s[-1] in EOS and len(s) < b for s, b in zip(result.sequences, BUDGETS))
    assert result.record[3].steps[0].committed == 0 and result.record[3].first_token is None
    if temperature == 0.0:
        assert result.stats.looked_up > 0


def test_greedy_lookup_and_bonus_tokens_are_marked(target, ragged_prompts) -> None:
    """The target drafting for itself: its own drafts are always accepted, so a step ends in a
    correction only where prompt lookup proposed the rejected draft; accepted looked-up drafts are
    marked as such."""
    result = speculative_generate(
        target, target, ragged_prompts, max_new_tokens=20, gamma=2, eos_token_ids=[], prompt_lookup=LOOKUP, record=True
    )
    kinds = check_against_stats(result, gamma=2)
    assert kinds["bonus"] > 0 and kinds["looked_up"] > 0 and kinds["accepted"] > 0
    for row in result.record:
        for step in row.steps[1:]:
            if step.target_kind == "corrected":
                assert step.looked_up[step.accepted]
            kept = min(step.accepted, step.committed)  # the budget may cut the last step
            assert [kind for _, kind in step.tokens()][:kept] == [
                "looked_up" if looked else "accepted" for looked in step.looked_up[:kept]
            ]


def test_autoregressive_record_is_all_target_tokens(target, ragged_prompts) -> None:
    result = autoregressive_generate(target, ragged_prompts, max_new_tokens=BUDGETS, eos_token_ids=EOS, record=True)
    assert [[token for token, _ in row.tokens()] for row in result.record] == result.sequences
    assert {kind for row in result.record for _, kind in row.tokens()} == {"target"}
    assert [row.tau for row in result.record if row.steps[0].committed] == pytest.approx(
        [1.0] * sum(b > 0 for b in BUDGETS)
    )


@pytest.mark.parametrize("drafter", ["derived", None])
def test_on_step_streams_each_steps_committed_tokens(target, ragged_prompts, drafter) -> None:
    events = []
    kwargs = dict(max_new_tokens=BUDGETS, eos_token_ids=EOS, on_step=events.append)
    if drafter is None:
        result = autoregressive_generate(target, ragged_prompts, **kwargs)
    else:
        result = speculative_generate(target, derive_drafter(target, 1), ragged_prompts, gamma=3, **kwargs)
    assert result.record is None  # streaming alone keeps no record
    streamed = [[] for _ in ragged_prompts]
    for event in events:
        for row, tokens in zip(event.rows, event.tokens):
            streamed[row] += [token for token, _ in tokens]
    assert streamed == result.sequences
    assert [e.time_s for e in events] == sorted(e.time_s for e in events)


def test_record_is_off_by_default_and_adds_no_host_sync(target, ragged_prompts, monkeypatch) -> None:
    """Recording keeps device tensors: the loop's syncs are the same with it on, plus one transfer
    at the end."""
    drafter = derive_drafter(target, 1)
    syncs = Counter()
    for name in ("tolist", "item", "__bool__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name):
            syncs[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)

    def run(**kwargs):
        syncs.clear()
        result = speculative_generate(target, drafter, ragged_prompts, max_new_tokens=BUDGETS, gamma=3, **kwargs)
        return result, sum(syncs.values())

    off, off_syncs = run()
    on, on_syncs = run(record=True)
    assert off.record is None and on.record is not None and on.sequences == off.sequences
    assert on_syncs == off_syncs + 1


def test_static_core_refuses_record_before_any_work() -> None:
    model = MarkovLM(successor_table(V, 1))
    for kwargs in ({"record": True}, {"on_step": print}):
        with pytest.raises(ValueError, match="static=False"):
            speculative_generate(model, model, [[1, 2]], max_new_tokens=4, static=True, **kwargs)
        with pytest.raises(ValueError, match="static=False"):
            autoregressive_generate(model, [[1, 2]], max_new_tokens=4, static=True, **kwargs)
    with pytest.raises(TypeError, match="record must be"):
        speculative_generate(model, model, [[1, 2]], max_new_tokens=4, record="yes")
    assert model.input_shapes == []


class _ByFirstToken:
    """A router stub: prompts whose text starts with "a" go to drafter `a`, the rest to no drafter."""

    drafters = ["a", "none"]

    def route(self, texts: list[str]) -> list[int]:
        return [0 if text.startswith("a") else 1 for text in texts]


def test_routed_records_name_their_drafter_and_stream_in_caller_rows(target, ragged_prompts) -> None:
    texts = ["a", "b", "a", "b", "b", "a", "a", "b"]
    events = []
    out = route_and_generate(
        _ByFirstToken(),
        target,
        {"a": derive_drafter(target, 1)},
        ragged_prompts,
        texts=texts,
        max_new_tokens=BUDGETS,
        gamma=3,
        eos_token_ids=EOS,
        record=True,
        on_step=events.append,
    )
    assert [row.drafter for row in out.records] == ["a" if t == "a" else "none" for t in texts]
    assert [[token for token, _ in row.tokens()] for row in out.records] == out.sequences
    for text, row in zip(texts, out.records):
        kinds = {kind for _, kind in row.tokens()}
        assert kinds == {"target"} if text == "b" and row.generated else kinds <= set(KINDS)
    streamed = [[] for _ in ragged_prompts]
    for event in events:
        for row, tokens in zip(event.rows, event.tokens):
            streamed[row] += [token for token, _ in tokens]
    assert streamed == out.sequences
