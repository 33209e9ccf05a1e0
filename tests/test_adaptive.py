"""Gamma chosen while decoding: the step-cost table, the choice, and the loop's exactness whatever
gammas it takes (0 included, in any order), greedy and sampled."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import specdecode.decoding.costs as costs_module
from specdecode import GenerationResult, autoregressive_generate, speculative_generate
from specdecode.decoding.adaptive import AdaptiveGamma
from specdecode.decoding.costs import StepTable, measure_step_table, step_table
from specdecode.decoding.decode import drafter_alpha
from specdecode.decoding.sampling import SamplingParams
from specdecode.models.feature_drafter import derive_feature_drafter
from tests.models_for_tests import tiny_llama
from tests.test_verify import follows_target, mc_feature_drafter, mc_generate, mc_models  # noqa: F401 (a fixture)

V = 64
FLAT = StepTable((1,), ((1.0, 1.0, 1.0, 1.0, 1.0),), 16)
# Steps whose drafts are timed apart: a draft costs 0.1 target steps at any batch size, a verify 0.1 more per token.
SPLIT = StepTable(
    (1, 8),
    tuple(tuple(1.0 + 0.2 * g for g in range(5)) for _ in range(2)),
    16,
    tuple(tuple(0.1 * g for g in range(5)) for _ in range(2)),
)


@dataclass(frozen=True)
class Scripted(AdaptiveGamma):
    """An adaptive gamma whose steps take `schedule`'s gammas in turn, whatever the acceptance."""

    schedule: tuple[int, ...] = (0,)
    chosen: list[int] = field(default_factory=list)

    def choose(self, expected: list[float], batch_size: int, groups: list[int] | None = None) -> int:
        gamma = self.schedule[len(self.chosen) % len(self.schedule)]
        self.chosen.append(gamma)
        return gamma


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(2, seed=0)


def drafter_of(kind: str, target: torch.nn.Module) -> torch.nn.Module:
    return target if kind == "self" else tiny_llama(1, seed=1) if kind == "slice" else derive_feature_drafter(target, 1)


@pytest.mark.parametrize("kind", ["self", "slice", "feature"])
@pytest.mark.parametrize("schedule", [(0, 3, 0, 0, 1, 4, 2), (2, 0), (4, 1, 1, 0, 0, 0)])
@pytest.mark.parametrize("lookup", [True, False])
def test_any_gamma_schedule_is_token_identical_to_the_target_alone(
    target, ragged_prompts, kind, schedule, lookup
) -> None:
    """Gamma 0 steps between drafting ones (the drafter catches up on the tokens it skipped), wider
    and narrower steps in turn, ragged prompts and budgets, an EOS id."""
    budgets = [24, 9, 30, 1, 17, 24, 5, 12]
    reference = autoregressive_generate(target, ragged_prompts, max_new_tokens=budgets, eos_token_ids=[7])
    extra: dict[str, Any] = {} if lookup else {"prompt_lookup": None}

    def scripted(policy: Scripted, **kwargs: Any) -> GenerationResult:
        drafter = drafter_of(kind, target)
        return speculative_generate(
            target, drafter, ragged_prompts, gamma=policy, max_new_tokens=budgets, eos_token_ids=[7], **extra, **kwargs
        )

    policy = Scripted(FLAT, schedule=schedule)
    result = scripted(policy)
    assert result.sequences == reference.sequences
    assert set(result.stats.gamma_steps) == set(schedule)
    assert result.stats.gamma == 4
    assert sum(result.stats.gamma_steps.values()) == len(policy.chosen) == result.stats.target_calls - 1
    # each row's record: a step per chosen gamma while it decoded, as many drafts as that gamma
    recorded = scripted(Scripted(FLAT, schedule=schedule), record=True)
    assert recorded.sequences == reference.sequences
    for record in recorded.record:
        drafted = [len(step.drafted) for step in record.steps[1:]]
        assert drafted == [schedule[i % len(schedule)] for i in range(len(drafted))]
    assert recorded.stats.drafted == sum(record.drafted for record in recorded.record)
    if kind == "self" and not lookup:
        assert result.stats.alpha == 1.0


@pytest.mark.parametrize("schedule", [(0, 2), (2, 0), (1, 0, 3)])
@pytest.mark.parametrize("drafter_kind", ["slice", "feature"])
def test_any_gamma_schedule_samples_the_target(mc_models, schedule, drafter_kind) -> None:  # noqa: F811
    """The G-test of tests/test_verify.py, each step's gamma taken from `schedule` (a target-only
    step then a drafting one, and the other way round)."""
    target, slice_drafter = mc_models
    drafter = slice_drafter if drafter_kind == "slice" else mc_feature_drafter(target)
    params = SamplingParams(0.7, top_k=3)
    result = mc_generate(target, drafter, params, seed=2, gamma=Scripted(FLAT, schedule=schedule))
    assert result.stats.accepted > 0 and 0 in result.stats.gamma_steps
    assert follows_target(result.sequences, target, params)


def test_where_no_draft_pays_every_step_is_the_targets_alone(target, ragged_prompts) -> None:
    """Drafting 100x a target step: no draft pays even at the prior, so the target decodes alone
    and the drafter never runs, not even its prefill."""
    costly = StepTable((1, 8), ((1.0, 100.0, 100.0), (1.0, 100.0, 100.0)), 16)
    drafter = tiny_llama(1, seed=1)
    calls: list[int] = []
    handle = drafter.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        result = speculative_generate(
            target, drafter, ragged_prompts, gamma=AdaptiveGamma(costly), max_new_tokens=16, eos_token_ids=[]
        )
    finally:
        handle.remove()
    assert (
        result.sequences
        == autoregressive_generate(target, ragged_prompts, max_new_tokens=16, eos_token_ids=[]).sequences
    )
    assert result.stats.drafted == 0 and result.stats.gamma_steps == {0: 15}
    assert calls == []


def test_the_opening_gamma_follows_the_priors_and_the_budgets() -> None:
    """Gamma 2 pays from alpha ~0.4 at these costs; a row with one token left gains nothing from drafts."""
    policy = AdaptiveGamma(StepTable((1,), ((1.0, 1.3, 1.6),), 16))
    assert policy.opening_gamma([0.9, 0.9]) == 2
    assert policy.opening_gamma([0.1, 0.1]) == 0
    assert policy.opening_gamma([0.9, 0.9], budgets=[1, 1]) == 0
    assert policy.opening_gamma([0.9, 0.0, 0.0, 0.0]) == 0  # one sure row does not carry three that draft nothing
    assert policy.fixed_gamma(8) == policy.opening_gamma([policy.prior_alpha] * 8)


def test_one_row_whose_drafter_pays_makes_the_batch_draft(target, ragged_prompts) -> None:
    """A mixed batch where one drafter's prior pays and the other's does not: the loop drafts; with
    both low, the target decodes alone and no drafter runs."""
    table = StepTable((1,), ((1.0, 1.3, 1.6),), 16)
    drafters = {"a": tiny_llama(1, seed=1), "b": tiny_llama(1, seed=2)}
    drafters["a"].config.specdecode_alpha = 0.95
    drafters["b"].config.specdecode_alpha = 0.05
    reference = autoregressive_generate(target, ragged_prompts[:2], max_new_tokens=12, eos_token_ids=[])
    kwargs = dict(gamma=AdaptiveGamma(table), max_new_tokens=12, eos_token_ids=[], prompt_lookup=None)
    drafting = speculative_generate(target, drafters, ragged_prompts[:2], assign=["a", "b"], **kwargs)
    alone = speculative_generate(target, drafters, ragged_prompts[:2], assign=["b", "b"], **kwargs)
    assert drafting.sequences == alone.sequences == reference.sequences
    assert drafting.stats.drafted > 0 and alone.stats.drafted == 0


def test_free_drafts_of_a_perfect_drafter_take_the_widest_step(target, ragged_prompts) -> None:
    """1 + 3 x 5 tokens, then a fourth step for the 4 left (fewer drafts would expect fewer)."""
    result = speculative_generate(
        target,
        target,
        ragged_prompts,
        gamma=AdaptiveGamma(FLAT, prior_alpha=0.9),
        max_new_tokens=20,
        eos_token_ids=[],
        prompt_lookup=None,
    )
    assert result.stats.gamma_steps == {4: 4}


def test_acceptance_moves_the_choice(target, ragged_prompts) -> None:
    """At costs where gamma 2 pays only above alpha ~0.4, an optimistic prior starts at gamma 2 and
    a drafter that is never accepted soon turns it to target-only steps."""
    table = StepTable((1,), ((1.0, 1.3, 1.6),), 16)
    policy = AdaptiveGamma(table, prior_alpha=0.9)
    assert policy.fixed_gamma(8) == 2
    never = tiny_llama(1, seed=1)
    result = speculative_generate(
        target, never, ragged_prompts, gamma=policy, max_new_tokens=40, eos_token_ids=[], prompt_lookup=None
    )
    assert result.stats.alpha is not None and result.stats.alpha < 0.2
    assert result.stats.gamma_steps[0] > sum(n for g, n in result.stats.gamma_steps.items() if g)


def test_the_table_reads_between_and_past_the_measured_batch_sizes() -> None:
    table = StepTable((1, 4), ((1.0, 2.0), (4.0, 8.0)), 16)
    assert table.at(1) == [1.0, 2.0] and table.at(4) == [4.0, 8.0]
    assert table.at(2) == pytest.approx([2.0, 4.0])
    assert table.at(7) == pytest.approx([7.0, 14.0])  # along the last two
    assert table.relative(4) == [1.0, 2.0]
    assert StepTable.from_dict(table.to_dict()) == table


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: StepTable((2, 1), ((1.0,), (1.0,)), 8), "batch_sizes must be ascending"),
        (lambda: StepTable((1,), ((1.0, 0.0),), 8), "must be > 0 seconds"),
        (lambda: StepTable((1, 2), ((1.0, 2.0),), 8), "one row per batch size"),
        (lambda: AdaptiveGamma(FLAT, prior_alpha=1.5), "prior_alpha must be in \\[0, 1\\], got 1.5"),
        (lambda: AdaptiveGamma(FLAT, max_gamma=9), "max_gamma must be an int in \\[1, 4\\].*got 9"),
        (lambda: AdaptiveGamma(FLAT, decay=0.0), "decay must be in \\(0, 1\\], got 0.0"),
        (lambda: StepTable((1,), ((1.0, 2.0),), 8, ((0.0, 3.0),)), "drafts must be empty or.*3.0"),
        (lambda: StepTable((1,), ((1.0, 2.0),), 8, ((0.0,),)), "drafts must be empty or"),
        (lambda: AdaptiveGamma(SPLIT, drafter_costs=(FLAT,)), "drafter_costs must be StepTables timing drafts"),
        (lambda: AdaptiveGamma(FLAT, calibrate="yes"), "calibrate must be True or False, got 'yes'"),
    ],
)
def test_bad_tables_and_policies_are_named(make, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        make()


@pytest.mark.parametrize(
    "gamma, error, needle",
    [("fast", ValueError, "gamma must be an int >= 1, 'auto'.*got 'fast'"), (2.5, TypeError, "got 2.5")],
)
def test_a_bad_gamma_is_named_before_any_work(target, gamma, error, needle) -> None:
    with pytest.raises(error, match=needle):
        speculative_generate(target, target, [[1, 2]], gamma=gamma, max_new_tokens=4)


@pytest.fixture
def counted_tables(target, monkeypatch, tmp_path) -> tuple[list[StepTable], Any, dict[str, Any]]:
    """A fresh table cache in `tmp_path`, every table measured into the returned list, a drafter
    and small measuring settings."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECDECODE_KERNEL_CACHE", raising=False)
    monkeypatch.setattr(costs_module, "_CHECKED", {})
    measured: list[StepTable] = []

    def measure(*args: Any, **kwargs: Any) -> StepTable:
        measured.append(measure_step_table(*args, **kwargs))
        return measured[-1]

    monkeypatch.setattr(costs_module, "measure_step_table", measure)
    return (
        measured,
        derive_feature_drafter(target, 1),
        dict(max_gamma=2, batch_sizes=(1, 2), context_tokens=12, repeats=1),
    )


def test_the_measured_table_is_kept_and_remeasured_on_request(target, counted_tables) -> None:
    measured, drafter, kwargs = counted_tables
    first = step_table(target, drafter, **kwargs)
    assert step_table(target, drafter, **kwargs) == first and len(measured) == 1
    assert first.batch_sizes == (1, 2) and first.max_gamma == 2 and all(s > 0 for row in first.seconds for s in row)
    step_table(target, drafter, SamplingParams(0.7), **kwargs)  # another sampling mode: its own table
    step_table(target, drafter, remeasure=True, **kwargs)
    assert len(measured) == 3


def test_a_table_agrees_within_the_stale_factor() -> None:
    table = StepTable((1, 8), ((0.04, 0.05, 0.08), (0.1, 0.2, 0.4)), 16)
    assert table.agrees(0.04, 0.08) and table.agrees(0.05, 0.10)
    assert not table.agrees(0.06, 0.12)  # a target step 1.5x the kept one
    assert not table.agrees(0.04, 0.12)  # the widest step 3 target steps, where 2 were kept


def test_a_kept_table_off_this_machine_is_measured_again(target, counted_tables, monkeypatch, tmp_path) -> None:
    """Read back from the cache, a table is spot-checked once per process: one whose steps are
    100x this machine's is measured again (with a warning naming both); one that agrees is kept."""
    measured, drafter, kwargs = counted_tables
    first = step_table(target, drafter, **kwargs)
    [kept] = (tmp_path / "cpu_kernels").glob("*.json")
    data = json.loads(kept.read_text())
    data["figures"]["seconds"] = [[100 * s for s in row] for row in data["figures"]["seconds"]]
    kept.write_text(json.dumps(data))
    monkeypatch.setattr(costs_module, "_CHECKED", {})  # another process
    with pytest.warns(UserWarning, match=r"off this machine's steps \(target step .* ms kept, .* ms now"):
        again = step_table(target, drafter, **kwargs)
    assert len(measured) == 2 and again != first and again.seconds[0][0] < 50 * first.seconds[0][0]
    assert step_table(target, drafter, **kwargs) is again and len(measured) == 2  # checked once per process
    monkeypatch.setattr(costs_module, "_CHECKED", {})
    monkeypatch.setattr(costs_module, "spot_check", lambda *a, **k: (again.seconds[0][0], again.seconds[0][-1]))
    assert step_table(target, drafter, **kwargs) == again and len(measured) == 2


def test_auto_on_a_static_decoder_takes_one_gamma_per_call(target, ragged_prompts, monkeypatch, tmp_path) -> None:
    """gamma="auto" measures (here: a stand-in table) and, on the static decoder, decodes at the
    table's best gamma for the batch at the drafter's stated acceptance; 0 decodes target-only."""
    reference = autoregressive_generate(target, ragged_prompts, max_new_tokens=12, eos_token_ids=[]).sequences
    for table, gammas in ((FLAT, {4}), (StepTable((1,), ((1.0, 50.0, 50.0),), 16), {0})):
        monkeypatch.setattr(specdecode_decode(), "step_table", lambda *a, table=table, **k: table)
        drafter = derive_feature_drafter(target, 1)
        drafter.config.specdecode_alpha = 0.7
        assert drafter_alpha(drafter) == 0.7
        result = speculative_generate(
            target, drafter, ragged_prompts, gamma="auto", max_new_tokens=12, eos_token_ids=[]
        )
        fixed = speculative_generate(
            target,
            drafter,
            ragged_prompts,
            gamma="auto",
            max_new_tokens=12,
            eos_token_ids=[],
            static=True,
            compile=False,
        )
        assert result.sequences == fixed.sequences == reference
        # the eager decode calibrates the stand-in table by its own step times: any gamma up to the table's
        assert fixed.stats.gamma in gammas and set(result.stats.gamma_steps) <= set(range(max(gammas) + 1))


def specdecode_decode() -> Any:
    import specdecode.decoding.decode

    return specdecode.decoding.decode


def test_the_drafters_stated_acceptance_is_the_prior(target) -> None:
    drafter = tiny_llama(1, seed=1)
    assert drafter_alpha(drafter) == 0.5
    for bad in (True, "x", 1.5):
        drafter.config.specdecode_alpha = bad
        assert drafter_alpha(drafter) == 0.5


def test_the_policy_spends_no_extra_host_sync(target, ragged_prompts, monkeypatch) -> None:
    """The per-gamma sums ride on the loop's one sync a step: as many `.tolist()` calls as with a fixed gamma."""
    counts = {}
    for name, gamma in (("fixed", 2), ("adaptive", Scripted(FLAT, schedule=(2,)))):
        calls = itertools.count()
        original = torch.Tensor.tolist

        def counting(self: torch.Tensor, calls: Any = calls) -> Any:
            next(calls)
            return original(self)

        monkeypatch.setattr(torch.Tensor, "tolist", counting)
        speculative_generate(target, target, ragged_prompts, gamma=gamma, max_new_tokens=12, eos_token_ids=[])
        monkeypatch.setattr(torch.Tensor, "tolist", original)
        counts[name] = next(calls)
    assert counts["adaptive"] == counts["fixed"]


@pytest.mark.parametrize("schedule", [(0, 3, 1), (2, 0, 0)])
def test_a_mixed_batch_takes_any_gamma_schedule_exactly(target, ragged_prompts, schedule) -> None:
    """Rows of two drafters and rows of none in one batch, each step's gamma from `schedule`: every
    drafter catches up after the target-only steps; each row's prior is its drafter's acceptance."""
    drafters = {"slice": tiny_llama(1, seed=1), "feature": derive_feature_drafter(target, 1)}
    drafters["feature"].config.specdecode_alpha = 0.8
    assign = ["slice", "feature", None, "feature", "slice", None, "feature", "slice"]
    reference = autoregressive_generate(target, ragged_prompts, max_new_tokens=20, eos_token_ids=[])
    policy = Scripted(FLAT, schedule=schedule)
    result = speculative_generate(
        target, drafters, ragged_prompts, assign=assign, gamma=policy, max_new_tokens=20, eos_token_ids=[], record=True
    )
    assert result.sequences == reference.sequences
    assert set(result.stats.gamma_steps) == set(schedule)
    assert [r.drafter for r in result.record] == assign


def test_a_mixed_batch_starts_each_row_at_its_drafters_acceptance(target, ragged_prompts, monkeypatch) -> None:
    started = []
    original = AdaptiveGamma.start

    def start(self, rows, device, prior=None):
        started.append(prior.tolist())
        return original(self, rows, device, prior)

    monkeypatch.setattr(AdaptiveGamma, "start", start)
    drafters = {"a": tiny_llama(1, seed=1), "b": tiny_llama(1, seed=2)}
    drafters["a"].config.specdecode_alpha = 0.25
    speculative_generate(
        target, drafters, ragged_prompts[:3], assign=["a", None, "b"], gamma=AdaptiveGamma(FLAT), max_new_tokens=4
    )
    assert started == [[0.25, 0.0, 0.5]]  # b states none: the default prior


@pytest.mark.parametrize("kind", ["feature", "slice"])
def test_long_stretches_of_target_only_steps_beside_a_long_row_that_finished(target, kind) -> None:
    """A long prompt with a short budget leaves early; the others then take 30 target-only steps
    between drafting ones: the drafter catches up within its cache, token for token the target's."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=generator).tolist() for n in (60, 3, 5)]
    budgets = [8, 60, 55]
    reference = autoregressive_generate(target, prompts, max_new_tokens=budgets, eos_token_ids=[])
    schedule = (1,) + (0,) * 30 + (4,)
    result = speculative_generate(
        target,
        drafter_of(kind, target),
        prompts,
        gamma=Scripted(FLAT, schedule=schedule),
        max_new_tokens=budgets,
        eos_token_ids=[],
    )
    assert result.sequences == reference.sequences
    assert result.stats.gamma_steps[0] >= 40


def test_a_mixed_batch_pays_each_drafters_drafts_at_its_own_rows() -> None:
    """The verify of the whole batch once, and each drafter's drafts at its own rows: four drafters
    of two rows each pay four times the drafts of one drafter of eight rows, here at the same cost."""
    policy = AdaptiveGamma(SPLIT, drafter_costs=(SPLIT,) * 4)
    assert policy.seconds(8) == SPLIT.at(8) == policy.seconds(8, None)
    assert policy.seconds(8, [2, 2, 2, 2]) == pytest.approx([1.0 + 0.1 * g + 0.4 * g for g in range(5)])
    assert policy.seconds(8, [8, 0, 0, 0]) == pytest.approx(SPLIT.at(8))
    # at alpha 0.6 one drafter's drafts (0.1 each) pay up to gamma 2; four drafters' (0.4) to gamma 1;
    # eight drafters' (0.8) not at all
    expected = [sum((1 - 0.6 ** (g + 1)) / 0.4 for _ in range(8)) for g in range(5)]
    assert policy.choose(expected, 8) == 2 and policy.choose(expected, 8, [2, 2, 2, 2]) == 1
    assert AdaptiveGamma(SPLIT, drafter_costs=(SPLIT,) * 8).choose(expected, 8, [1] * 8) == 0
    assert AdaptiveGamma(SPLIT).choose(expected, 8, [2, 2, 2, 2]) == 2  # no drafter_costs: the one table
    assert AdaptiveGamma(SPLIT, drafter_costs=(SPLIT,) * 8).opening_gamma([0.6] * 8, groups=[1] * 8) == 0


def test_a_measured_table_keeps_each_steps_drafts_apart(target, counted_tables) -> None:
    measured, drafter, kwargs = counted_tables
    table = step_table(target, drafter, **kwargs)
    assert [row[0] for row in table.drafts] == [0.0, 0.0]
    assert all(0 < d < s for drafts, row in zip(table.drafts, table.seconds) for d, s in zip(drafts[1:], row[1:]))
    assert StepTable.from_dict(json.loads(json.dumps(table.to_dict()))) == table


def test_auto_times_each_drafter_of_a_mixed_batch_and_the_loop_passes_its_rows(
    target, ragged_prompts, counted_tables, monkeypatch
) -> None:
    """gamma="auto" over two drafters of other shapes measures a table for each; each step's choice
    sees the rows per drafter, which shrink as rows finish."""
    _, drafter, _ = counted_tables
    measured: list[str] = []
    cheap = StepTable(
        (1, 8), tuple(tuple(1.0 + 0.2 * g for g in range(7)) for _ in range(2)), 16,
        tuple(tuple(0.1 * g for g in range(7)) for _ in range(2)),
    )  # fmt: skip

    def measure(target, drafter, *args, **kwargs):
        measured.append(type(drafter).__name__)
        return cheap

    monkeypatch.setattr(costs_module, "measure_step_table", measure)
    seen: list[list[int] | None] = []
    original = AdaptiveGamma.choose

    def choose(self, expected, batch_size, groups=None):
        seen.append(groups)
        return original(self, expected, batch_size, groups)

    monkeypatch.setattr(AdaptiveGamma, "choose", choose)
    drafters = {"a": tiny_llama(1, seed=1), "b": drafter}
    for model in drafters.values():
        model.config.specdecode_alpha = 0.99
    assign = ["a", "b", None, "a", "b", "b", None, "a"]
    budgets = [4, 12, 12, 12, 12, 12, 12, 12]
    result = speculative_generate(
        target, drafters, ragged_prompts, assign=assign, gamma="auto", max_new_tokens=budgets, eos_token_ids=[]
    )
    reference = autoregressive_generate(target, ragged_prompts, max_new_tokens=budgets, eos_token_ids=[])
    assert result.sequences == reference.sequences
    assert sorted(measured) == ["FeatureDrafter", "LlamaForCausalLM"]
    assert seen[0] == [3, 3] and seen[-1] == [2, 3]  # a's row with 4 tokens left the batch


def test_steps_slower_than_the_table_move_the_choice(monkeypatch) -> None:
    """The decode times each step between the loop's syncs. Calibrated, it first drafts once (the
    table puts gamma 1 within `PROBE_SHARE` of a target step): drafting timed at 3x its seconds, it
    takes target steps from then on, even where the table says gamma 2. Only the two kinds' ratio
    counts (a slower machine favours neither, after one probing target step); uncalibrated, or with
    steps as the table says, the table alone decides after the probe."""
    import specdecode.decoding.adaptive as adaptive_module

    now = [0.0]
    monkeypatch.setattr(adaptive_module.time, "perf_counter", lambda: now[0])
    table = StepTable((1,), ((1.0, 1.3, 1.6),), 16)
    low, high = [1.0, 1.2, 1.3], [1.0, 1.7, 2.19]  # one row at alpha 0.2 (gamma 0 pays) and at 0.7 (gamma 2)

    def run(calibrate: bool, slow: dict[int, float], steps: int) -> list[int]:
        state = AdaptiveGamma(table, calibrate=calibrate).start(1, torch.device("cpu"))
        chosen = []
        for step in range(steps):
            chosen.append(state.choose(low if step < 3 else high, 1))
            now[0] += table.at(1)[chosen[-1]] * slow.get(min(chosen[-1], 1), 1.0)
        return chosen

    assert run(False, {1: 3.0}, 12) == [0] * 3 + [2] * 9
    assert run(True, {1: 3.0}, 12) == [1] + [0] * 11
    assert run(True, {}, 12) == [1, 0, 0] + [2] * 9  # steps as the table says: the table's choices
    assert run(True, {0: 3.0, 1: 3.0}, 12) == [1, 0, 0] + [2] * 9  # all 3x slower: the same choices
    # drafting timed first, at 3x: a target step is tried to weigh it against; on a machine 3x slower
    # at both kinds that step is 3x too, and drafting resumes after one probe
    state = AdaptiveGamma(table, calibrate=True).start(1, torch.device("cpu"))
    chosen = []
    for _ in range(10):
        chosen.append(state.choose(high, 1))
        now[0] += 3.0 * table.at(1)[chosen[-1]]
    assert chosen == [2, 0] + [2] * 8 and state.relative() == pytest.approx(1.0)
    assert state.scale == pytest.approx([3.0, 3.0])
    # with only drafting dear and no target step timed yet, the choice turns to target steps and stays
    state = AdaptiveGamma(table, calibrate=True).start(1, torch.device("cpu"))
    chosen = []
    for _ in range(10):
        chosen.append(state.choose(high, 1))
        now[0] += table.at(1)[chosen[-1]] * (3.0 if chosen[-1] else 1.0)
    assert chosen == [2] + [0] * 9 and state.relative() == pytest.approx(2.0)


def test_a_calibrated_decode_drafts_once_where_the_table_is_close(target, ragged_prompts) -> None:
    """At alpha 0.1 the table says no draft pays, but puts gamma 1 within `PROBE_SHARE` of a target
    step: a calibrated decode drafts to time it (exactly), an uncalibrated one and a static decoder's
    single gamma trust the table; a table where drafting is far dearer is trusted either way."""
    close = StepTable((1, 8), ((1.0, 1.3, 1.6), (1.0, 1.3, 1.6)), 16)
    dear = StepTable((1,), ((1.0, 2.0, 3.0),), 16)
    assert AdaptiveGamma(close).opening_gamma([0.1, 0.1]) == 0
    assert AdaptiveGamma(close, calibrate=True).opening_gamma([0.1, 0.1]) == 1
    assert AdaptiveGamma(close, prior_alpha=0.1, calibrate=True).fixed_gamma(2) == 0
    assert AdaptiveGamma(dear, calibrate=True).opening_gamma([0.1, 0.1]) == 0
    assert AdaptiveGamma(close).probe_gamma([1.0, 1.1, 1.11], 1) == 1
    assert AdaptiveGamma(dear).probe_gamma([1.0, 1.1, 1.11], 1) == 0
    reference = autoregressive_generate(target, ragged_prompts, max_new_tokens=16, eos_token_ids=[]).sequences
    for calibrate in (False, True):
        policy = AdaptiveGamma(close, prior_alpha=0.1, calibrate=calibrate, leave_after=3)
        result = speculative_generate(
            target,
            tiny_llama(1, seed=1),
            ragged_prompts,
            gamma=policy,
            max_new_tokens=16,
            eos_token_ids=[],
            prompt_lookup=None,
        )
        assert result.sequences == reference
        assert (result.stats.drafted > 0) == calibrate and (1 in result.stats.gamma_steps) == calibrate


def test_auto_calibrates_and_a_sampled_decode_starts_at_its_temperatures_acceptance(
    target, ragged_prompts, monkeypatch
) -> None:
    """`gamma="auto"` scales its table by the decode's steps; its prior at T lies between the greedy
    acceptance and the sampled one stored at temperature t, linear in T up to t; bad entries fall back."""
    drafter = derive_feature_drafter(target, 1)
    drafter.config.specdecode_alpha = 0.6
    drafter.config.specdecode_alpha_sampled = {"temperature": 1.0, "alpha": 0.4}
    assert [drafter_alpha(drafter, t) for t in (0.0, 0.5, 1.0, 1.5)] == pytest.approx([0.6, 0.5, 0.4, 0.4])
    for bad in ({"temperature": 0.0, "alpha": 0.4}, {"temperature": 1.0, "alpha": 1.5}, {"alpha": 0.4}, 0.4):
        drafter.config.specdecode_alpha_sampled = bad
        assert drafter_alpha(drafter, 0.7) == 0.6
    drafter.config.specdecode_alpha_sampled = {"temperature": 1.0, "alpha": 0.4}
    monkeypatch.setattr(specdecode_decode(), "step_table", lambda *a, **k: FLAT)
    policy = specdecode_decode().adaptive_gamma(target, drafter, SamplingParams(0.5))
    assert policy.calibrate and policy.prior_alpha == pytest.approx(0.5)
    assert not AdaptiveGamma(FLAT).calibrate
    reference = autoregressive_generate(target, ragged_prompts, max_new_tokens=12, eos_token_ids=[]).sequences
    result = speculative_generate(target, drafter, ragged_prompts, gamma="auto", max_new_tokens=12, eos_token_ids=[])
    assert result.sequences == reference


@pytest.mark.parametrize("kind", ["slice", "feature"])
def test_after_leave_after_target_steps_the_target_decodes_alone(target, ragged_prompts, kind) -> None:
    """A drafter never accepted at costs where drafts pay only above alpha ~0.4: once the policy has
    taken `leave_after` target steps in a row, the drafter never runs again, and the output is the
    target's own; every step after the first is counted as a gamma-0 step."""
    table = StepTable((1,), ((1.0, 1.3, 1.6),), 16)
    drafter = tiny_llama(1, seed=1) if kind == "slice" else derive_feature_drafter(target, 1)
    calls: list[int] = []
    drafter.register_forward_pre_hook(lambda *a: calls.append(1))
    reference = autoregressive_generate(target, ragged_prompts, max_new_tokens=40, eos_token_ids=[])
    results = {}
    for leave_after in (None, 3):
        calls.clear()
        policy = AdaptiveGamma(table, prior_alpha=0.9, leave_after=leave_after)
        result = speculative_generate(
            target, drafter, ragged_prompts, gamma=policy, max_new_tokens=40, eos_token_ids=[], prompt_lookup=None
        )
        assert result.sequences == reference.sequences
        assert sum(result.stats.gamma_steps.values()) == result.stats.target_calls - 1
        results[leave_after] = (len(calls), result.stats.gamma_steps)
    (stayed, stayed_steps), (left, left_steps) = results[None], results[3]
    assert left < stayed and left_steps[0] > stayed_steps[0]  # the loop left: fewer drafter calls, no retry
    with pytest.raises(ValueError, match="leave_after"):
        AdaptiveGamma(table, leave_after=0)


def test_a_row_never_accepted_is_estimated_near_zero_and_retried_after_idle_steps() -> None:
    """The prior's weight fades with each drafting step, so thirty rejected drafts put a row at
    alpha 0.5 near 0 (a fixed weight of 2 would hold it at 1/12); a long run of target steps brings
    the weight and the estimate back to the prior, so drafting is tried again."""
    state = AdaptiveGamma(FLAT, prior_alpha=0.5).start(2, torch.device("cpu"))
    for _ in range(30):
        state.update(torch.tensor([0, 1]), 1)
    assert state.alpha()[0] < 0.01 and state.alpha()[1] > 0.99
    for _ in range(500):
        state.update(None, 0)
    assert state.alpha() == pytest.approx([0.5, 0.5], abs=0.02)
    assert state.weight == pytest.approx([2.0, 2.0], abs=0.02)
