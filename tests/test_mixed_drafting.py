"""One batch, many drafters (`specdecode.decoding.mixed`): rows routed to different drafters decode
in one batch, each drafting with its own and one target pass per step verifying all. Greedy stays
the target's token for token, sampling follows the target (the G-test of tests/test_verify.py),
and the evaluation's routed method decodes its batches so, beside `routed_grouped`."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from specdecode import autoregressive_generate, speculative_generate
from specdecode.decoding.mixed import MixedDrafting, union_layers
from specdecode.decoding.sampling import SamplingParams
from specdecode.decoding.stats import GenerationResult, StepCounters
from specdecode.evaluation import suite
from specdecode.evaluation.records import run_interleaved
from specdecode.evaluation.suite import run_eval
from specdecode.models import derive_drafter
from specdecode.models.eagle3_drafter import derive_eagle3_drafter
from tests.models_for_tests import tiny_llama
from tests.test_evaluation import FixedRouter, routed_config, tiny_setup  # noqa: F401 (a fixture)
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
# Each set's drafters and each row's: the target's own copy (every draft right), a slice, feature
# drafters reading one layer, two (normed) and three raw (EAGLE-3), and rows with none. `short`
# drafts only for rows 1, 4 and 7, which finish first: its part leaves the batch while others run.
ASSIGNS = {
    "shared": ["copy", "short", None, "feature", "short", "copy", "feature", "short"],
    "union": ["layers", "eagle3", "feature", None, "short", "layers", "eagle3", "short"],
}


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(4, seed=0)


@pytest.fixture(scope="module")
def drafters(target) -> dict[str, torch.nn.Module]:
    return {
        "copy": derive_drafter(target, 4),
        "short": derive_drafter(target, 1),
        "feature": random_feature_drafter(target),
        "layers": random_feature_drafter(target, seed=2, feature_layers=(1, -1)),
        "eagle3": derive_eagle3_drafter(target, feature_layers=(1, 2, 3)),
    }


@pytest.fixture(scope="module")
def early_eos(target, ragged_prompts) -> int:
    """A token that row 2's greedy continuation writes early: it stops that row (and any other that
    writes it) mid-way, while other rows run on."""
    return autoregressive_generate(target, ragged_prompts, max_new_tokens=BUDGETS, eos_token_ids=[]).sequences[2][4]


def mixed(target, drafters, ragged_prompts, assign, **kwargs: Any) -> GenerationResult:
    used = {name: drafters[name] for name in assign if name is not None}
    return speculative_generate(
        target, used, ragged_prompts, assign=assign, max_new_tokens=BUDGETS, record=True, **kwargs
    )


@pytest.mark.parametrize("gamma", [1, 3])
@pytest.mark.parametrize("layout", list(ASSIGNS))
def test_greedy_mixed_batch_is_the_targets_token_for_token(
    target, drafters, ragged_prompts, early_eos, layout, gamma
) -> None:
    """A ragged batch of 8 with per-row budgets (0 and 1 among them) and an EOS that stops rows
    mid-way: the target's tokens; each row's record names its drafter, the copy's rows accept every
    draft, the rows without a drafter have none, and the counters are the records' sums."""
    assign = ASSIGNS[layout]
    alone = autoregressive_generate(target, ragged_prompts, max_new_tokens=BUDGETS, eos_token_ids=[early_eos])
    result = mixed(target, drafters, ragged_prompts, assign, gamma=gamma, eos_token_ids=[early_eos])
    assert result.sequences == alone.sequences
    assert any(len(s) < b for s, b in zip(result.sequences, BUDGETS))  # the EOS stopped a row early
    assert result.record is not None
    assert [r.drafter for r in result.record] == assign
    for record, name in zip(result.record, assign):
        if name is None:
            assert record.drafted == 0 and record.generated == len(record.steps)
        if name == "copy":
            assert record.accepted == record.drafted > 0
    assert result.stats.accepted == sum(r.accepted for r in result.record) > 0
    assert result.stats.drafted == sum(r.drafted for r in result.record)
    assert result.stats.gamma == gamma


def test_looked_up_drafts_are_flagged_in_their_own_rows(target, drafters, ragged_prompts) -> None:
    """With a lookup that fills most drafts, each sub's lookup mask lands on its rows: the records'
    flags add up to the count, and no row without a drafter has one."""
    assign = ASSIGNS["union"]
    result = mixed(target, drafters, ragged_prompts, assign, gamma=3, eos_token_ids=[], prompt_lookup=EAGER_LOOKUP)
    alone = autoregressive_generate(target, ragged_prompts, max_new_tokens=BUDGETS, eos_token_ids=[])
    assert result.sequences == alone.sequences
    assert result.record is not None
    flags = [sum(sum(step.looked_up) for step in record.steps) for record in result.record]
    assert result.stats.looked_up == sum(flags) > 0
    assert all(flags[i] == 0 for i, name in enumerate(assign) if name is None)


def test_each_row_drafts_with_its_own_drafter(target, drafters, ragged_prompts) -> None:
    """Per drafter, its rows in the mixed batch accept exactly as many drafts as they do decoded in
    a batch of their own with it (a row given another's drafts would not)."""
    assign = ASSIGNS["union"]
    result = mixed(target, drafters, ragged_prompts, assign, gamma=3, eos_token_ids=[])
    assert result.record is not None
    for name in {n for n in assign if n is not None}:
        rows = [i for i, n in enumerate(assign) if n == name]
        own = speculative_generate(
            target,
            drafters[name],
            [ragged_prompts[i] for i in rows],
            max_new_tokens=[BUDGETS[i] for i in rows],
            gamma=3,
        )
        assert sum(result.record[i].accepted for i in rows) == own.stats.accepted, name


def test_a_drafter_whose_rows_finish_leaves_the_batch(target, drafters, ragged_prompts, monkeypatch) -> None:
    """Once `short`'s rows (budgets 3, 0, 1) are done, the steps draft with the others alone; the
    copy's row (every draft accepted) ends before the feature drafter's of the same budget."""
    parts: list[int] = []
    propose = MixedDrafting.propose

    def counted(self, *args: Any) -> Any:
        parts.append(len(self.parts))
        return propose(self, *args)

    monkeypatch.setattr(MixedDrafting, "propose", counted)
    mixed(target, drafters, ragged_prompts, ASSIGNS["shared"], gamma=2, eos_token_ids=[])
    assert parts == sorted(parts, reverse=True) and (parts[0], parts[-1]) == (3, 1) and 2 in parts


def test_the_verify_reads_the_union_of_the_layers_read() -> None:
    """-1 is the last state (index L); sorted raw indices, so `target_features` returns them raw."""
    assert union_layers([(-1,), (1, -1), (1, 2, 3)], 4) == (1, 2, 3, 4)
    assert union_layers([(2, 3, 1)], 4) == (1, 2, 3)


def test_a_batch_of_rows_without_a_drafter_is_the_target_alone(target, drafters, ragged_prompts) -> None:
    result = speculative_generate(
        target, {"copy": drafters["copy"]}, ragged_prompts, assign=[None] * 8, max_new_tokens=5
    )
    assert result.sequences == autoregressive_generate(target, ragged_prompts, max_new_tokens=5).sequences
    assert result.stats.drafted == 0 and result.stats.tau == 1.0


# --- sampling: each drafter's rows follow the target ----------------------------------------------

MC_ASSIGN = ["slice", "feature", None, "layers"]


def mc_mixed(target, drafter, params: SamplingParams, seed: int) -> GenerationResult:
    drafters = {
        "slice": drafter,
        "feature": mc_feature_drafter(target),
        "layers": random_feature_drafter(target, seed=13, std=0.3, feature_layers=(1, -1)),
    }
    return speculative_generate(
        target,
        drafters,
        [PROMPT] * N_SAMPLES,
        assign=MC_ASSIGN * (N_SAMPLES // len(MC_ASSIGN)),
        gamma=3,
        max_new_tokens=N_TOKENS,
        temperature=params.temperature,
        top_k=params.top_k,
        eos_token_ids=[],
        seed=seed,
    )


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=3)], ids=["t1.0", "t0.7-k3"])
def test_sampled_rows_of_every_drafter_follow_the_target(mc_models, params) -> None:
    target, drafter = mc_models
    result = mc_mixed(target, drafter, params, seed=0)
    assert result.stats.accepted > 0
    expected = exact_joint(target, params)
    for k, name in enumerate(MC_ASSIGN):
        observed = joint_counts(result.sequences[k :: len(MC_ASSIGN)])
        assert g_test_pvalue(observed, expected) > SIGNIFICANCE, name
    assert g_test_pvalue(joint_counts(result.sequences), expected) > SIGNIFICANCE


def test_distribution_test_catches_placeholder_drafts_judged(mc_models, monkeypatch) -> None:
    """Planted bug: the rows without a drafter have their placeholder drafts judged like real ones."""
    layout = MixedDrafting._layout

    def judged_all(self) -> None:
        layout(self)
        self.drafting_rows = None

    monkeypatch.setattr(MixedDrafting, "_layout", judged_all)
    target, drafter = mc_models
    params = SamplingParams(1.0)
    result = mc_mixed(target, drafter, params, seed=0)
    observed = joint_counts(result.sequences[MC_ASSIGN.index(None) :: len(MC_ASSIGN)])
    assert g_test_pvalue(observed, exact_joint(target, params)) < SIGNIFICANCE


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "drafter, assign, kwargs, error, needle",
    [
        ("map", ["copy", "nope"] + ["copy"] * 6, {}, ValueError, "'nope'"),
        ("map", ["copy"] * 7, {}, ValueError, "7 drafter names for 8 prompts"),
        ("map", None, {}, TypeError, "assign must list"),
        ("map", "copy", {}, TypeError, "assign must list"),
        ("one", ["copy"] * 8, {}, TypeError, "mapping of names to drafters"),
        ("empty", ["copy"] * 8, {}, TypeError, "non-empty mapping"),
        ("vocab", ["small"] * 8, {}, ValueError, "drafter 'small': target and drafter vocabularies differ"),
        ("map", ["copy"] * 8, {"static": True}, ValueError, "eager decoder"),
    ],
)
def test_bad_drafters_and_assignments_are_named_before_any_work(
    target, drafters, ragged_prompts, monkeypatch, drafter, assign, kwargs, error, needle
) -> None:
    given = {
        "map": {"copy": drafters["copy"]},
        "one": drafters["copy"],
        "empty": {},
        "vocab": {"small": tiny_llama(1, vocab_size=32)},
    }[drafter]

    def no_work(*args: Any, **kw: Any) -> None:
        raise AssertionError("the target ran before the input was checked")

    monkeypatch.setattr(target, "forward", no_work)
    with pytest.raises(error, match=needle):
        speculative_generate(target, given, ragged_prompts, assign=assign, max_new_tokens=4, **kwargs)


# --- the evaluation: routed in one batch, routed_grouped by drafter ---------------------------------


def test_chosen_methods_decode_mixed_batches_past_batch_1_unless_grouped() -> None:
    calls: list[tuple[str, int, tuple[str, ...]]] = []

    def pooled(name: str) -> Any:
        def generate(batch: list[list[int]]) -> GenerationResult:
            calls.append((name, len(batch), ()))
            return result([[len(p), ord(name)] for p in batch])

        return generate

    def route(batch: list[list[int]], choices: list[str]) -> GenerationResult:
        calls.append(("mixed", len(batch), tuple(choices)))
        return result([[len(p), ord(c)] for p, c in zip(batch, choices)])

    def result(sequences: list[list[int]]) -> GenerationResult:
        counters = StepCounters(0, torch.device("cpu"))
        counters.record_target_call(len(sequences))
        return GenerationResult.build(sequences, counters, 1.0)

    prompts = [[1] * n for n in range(1, 5)]
    pool = {name: pooled(name) for name in ("a", "b")}
    choices = ["b", "a", "b", "a"]
    chosen = {"routed": choices, "routed_grouped": choices}
    records = run_interleaved({}, prompts, 2, chosen=chosen, pool=pool, route=route, grouped={"routed_grouped"})
    assert sorted(calls) == sorted([("mixed", 2, ("b", "a")), ("mixed", 2, ("b", "a")), ("b", 2, ()), ("a", 2, ())])
    expected = [[n, ord(c)] for n, c in zip(range(1, 5), choices)]
    assert records["routed"].sequences == records["routed_grouped"].sequences == expected
    calls.clear()
    run_interleaved({}, prompts, 1, chosen={"routed": choices}, pool=pool, route=route)
    assert [name for name, _, _ in calls] == choices  # batch 1: each prompt with its drafter alone


class AlternatingRouter(FixedRouter):
    """Routes the prompts to its two drafters in turn, so every batch of two mixes them."""

    def choose(self, texts: list[str]) -> list[str]:
        return [(self.short, self.long)[i % 2] for i in range(len(texts))]


def test_run_eval_routes_in_one_batch_beside_routed_grouped(tiny_setup, monkeypatch) -> None:  # noqa: F811
    """At batch 2 the routed rows decode mixed batches (one call with `assign` per batch) and the
    routed_grouped rows one batch per drafter; both are the target's tokens."""
    assigned: list[list[str | None]] = []
    decode = suite.speculative_generate

    def spy(*args: Any, assign: Any = None, **kwargs: Any) -> GenerationResult:
        if assign is not None:
            assigned.append(list(assign))
        return decode(*args, assign=assign, **kwargs)

    monkeypatch.setattr(suite, "speculative_generate", spy)
    tmp_path, folders = tiny_setup
    cfg = routed_config(
        tmp_path,
        folders,
        methods=["autoregressive", "generic", "specialized", "routed", "routed_grouped"],
        domains=["code"],
        prompts_per_domain=4,
        max_new_tokens=6,
        temperatures=[0.0],
        batch_sizes=[1, 2],
        token_pages=0,
    )
    run_eval(cfg, router_loader=lambda path: AlternatingRouter("generic", "code"))
    rows = json.loads((tmp_path / "eval" / "results.json").read_text())["rows"]
    by_key = {(r["method"], r["batch_size"]): r for r in rows}
    assert ("routed_grouped", 1) not in by_key
    for key in [("routed", 1), ("routed", 2), ("routed_grouped", 2)]:
        assert by_key[key]["exact_match"] == 1.0, key
    assert by_key[("routed", 2)]["tokens"] == by_key[("routed_grouped", 2)]["tokens"]
    assert assigned and all(len(a) == 2 for a in assigned)
    assert all(set(a) == {"generic", "specialized:code"} for a in assigned), assigned
