"""The evaluation suite end to end on tiny models: every method, schema, exact match, oracle, report."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import pytest
import torch

from specdecode import speculative_generate
from specdecode.decoding.adaptive import AdaptiveGamma
from specdecode.decoding.costs import StepTable
from specdecode.decoding.lookup import PromptLookup
from specdecode.decoding.stats import GenerationResult, StepCounters
from specdecode.evaluation import records, suite
from specdecode.evaluation.config import EvalConfig
from specdecode.evaluation.records import (
    RunRecord,
    composed,
    merge_counts,
    pick_per_prompt,
    router_share,
    run_batched,
    run_interleaved,
)
from specdecode.evaluation.report import merge_results
from specdecode.evaluation.suite import run_eval
from specdecode.models import derive_drafter
from specdecode.models.config import DrafterConfig, TargetConfig

ROW_FIELDS = {
    "domain",
    "method",
    "gamma",
    "temperature",
    "batch_size",
    "alpha",
    "tau",
    "tokens_per_s",
    "speedup",
    "exact_match",
}


class FixedRouter:
    """Routes every prompt whose text is longer than `cut` characters to `long`, the rest to `short`."""

    def __init__(self, short: str, long: str, cut: int = 200) -> None:
        self.short, self.long, self.cut = short, long, cut
        self.drafters = [short, long]  # what it was fitted on, as a `Router` says

    def choose(self, texts: list[str]) -> list[str]:
        return [self.long if len(t) > self.cut else self.short for t in texts]


class RecordingRouter(FixedRouter):
    """A `FixedRouter` that keeps every choice it made."""

    def __init__(self, short: str, long: str, cut: int = 200) -> None:
        super().__init__(short, long, cut)
        self.chosen: list[str] = []

    def choose(self, texts: list[str]) -> list[str]:
        choices = super().choose(texts)
        self.chosen += choices
        return choices


@pytest.fixture
def tiny_setup(tmp_path, make_tiny_llama, make_tiny_tokenizer):
    target = make_tiny_llama(num_hidden_layers=3)
    tokenizer = make_tiny_tokenizer()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    folders = {}
    for name, layers in (("generic", 1), ("code", 2)):
        folders[name] = str(tmp_path / name)
        derive_drafter(target, layers).save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    return tmp_path, folders


def routed_config(tmp_path, folders, **settings) -> EvalConfig:
    """An evaluation of the `tiny_setup` target and drafters, gamma 2, with a router folder the
    tests' fake loader ignores; `settings` give the rest (and may set another gamma)."""
    return EvalConfig(
        target=TargetConfig(name=str(tmp_path / "target")),
        drafters=folders,
        router_dir="unused-by-the-fake-loader",
        max_prompt_tokens=150,
        output_dir=str(tmp_path / "eval"),
        **({"gamma": 2} | settings),
    )


def test_run_eval_writes_every_method_with_exact_greedy(tiny_setup) -> None:
    tmp_path, folders = tiny_setup
    cfg = routed_config(
        tmp_path,
        folders,
        undistilled=DrafterConfig(num_layers=1, draft_vocab=None),
        domains=["code", "math"],
        prompts_per_domain=3,
        max_new_tokens=6,
        temperatures=[0.0, 1.0],
        batch_sizes=[1, 2],
    )
    # Short prompts go to the undistilled drafter: a route outside the oracle's candidates, whose
    # batch-1 run the router's choices (`routed_choices`) are then scored on too.
    router = RecordingRouter("undistilled", "code")
    results = run_eval(cfg, router_loader=lambda path: router)
    assert set(router.chosen) == {"undistilled", "code"}

    written = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert written["rows"] == results["rows"]
    methods = {r["method"] for r in written["rows"] if r["method"] != "routed_choices"}
    assert methods == {"autoregressive", "undistilled", "generic", "specialized:code", "routed", "oracle"}
    # domains x temperatures x batch sizes x methods, and the router's choices on the oracle's runs at batch 1
    assert len(written["rows"]) == 2 * 2 * 2 * len(methods) + 2 * 2
    by_key = {(r["domain"], r["method"], r["temperature"], r["batch_size"]): r for r in written["rows"]}
    for domain in ("code", "math"):
        for temperature in (0.0, 1.0):
            routed, choices = (
                by_key[(domain, "routed", temperature, 1)],
                by_key[(domain, "routed_choices", temperature, 1)],
            )
            # the same choices, decoded the same way (seeded), timed in the drafters' own runs
            assert (choices["tokens"], choices["tau"], choices["alpha"]) == (
                routed["tokens"],
                routed["tau"],
                routed["alpha"],
            )
            assert choices["exact_match"] == (1.0 if temperature == 0.0 else None)
    assert sorted((s["temperature"], s["batch_size"]) for s in written["router_share"]) == [
        (0.0, 1),
        (0.0, 2),
        (1.0, 1),
        (1.0, 2),
    ]
    assert all("routed_choices_share" in s for s in written["router_share"] if s["batch_size"] == 1)
    for r in written["rows"]:
        assert ROW_FIELDS <= set(r)
        if r["temperature"] == 0.0:
            assert r["exact_match"] == 1.0, r
        else:
            assert r["exact_match"] is None
        if r["method"] == "autoregressive":
            assert r["speedup"] == 1.0 and r["tau"] == 1.0
    report = (tmp_path / "eval" / "report.md").read_text()
    assert "| code | routed |" in report
    assert "## The router's share of the oracle's gain" in report
    for png in ("speedup.png", "gamma_sweep.png", "position_acceptance.png"):
        assert (tmp_path / "eval" / png).stat().st_size > 1000


def test_a_router_fitted_on_a_drafter_the_run_lacks_is_named_before_any_model_loads(tiny_setup, monkeypatch) -> None:
    """A router that may choose a drafter the run was not given is refused before any model loads
    and any decoding starts, naming the drafters it lacks and those the run has."""
    tmp_path, folders = tiny_setup
    monkeypatch.setattr(suite, "load_target", lambda *a, **k: pytest.fail("the target loaded"))
    cfg = routed_config(tmp_path, folders, domains=["code"], prompts_per_domain=3)
    with pytest.raises(ValueError, match=r"routes to \['math'\], which drafters lacks \(it has \['code', 'generic'\]"):
        run_eval(cfg, router_loader=lambda path: FixedRouter("generic", "math"))
    assert not (tmp_path / "eval" / "results.json").exists()


@pytest.mark.parametrize("chooser", ["routed", "oracle"])
def test_routed_or_oracle_alone_load_the_drafters_they_choose_between(tiny_setup, chooser: str, monkeypatch) -> None:
    """`methods=[autoregressive, routed]` routes to drafters whose own rows were not asked for (it
    once failed with KeyError 'specialized:code' after loading everything); the oracle runs the
    candidates at batch 1 to pick from, and writes only its own rows. Greedy stays exact."""
    tmp_path, folders = tiny_setup
    batched = []  # batch size of each whole-method run (the oracle's and the router's groups run apart)
    monkeypatch.setattr(
        suite, "run_batched", lambda fn, ids, batch_size: batched.append(batch_size) or run_batched(fn, ids, batch_size)
    )
    turns = []  # (batch size, methods) of each run where the methods take turns

    def interleaved(fns, ids, batch_size, chosen=None, pool=None, **batching):
        turns.append((batch_size, sorted(fns) + sorted(chosen or {})))
        return run_interleaved(fns, ids, batch_size, chosen, pool, **batching)

    monkeypatch.setattr(suite, "run_interleaved", interleaved)
    cfg = routed_config(
        tmp_path,
        folders,
        methods=["autoregressive", chooser],
        domains=["code"],
        prompts_per_domain=2,
        max_new_tokens=6,
        temperatures=[0.0],
        batch_sizes=[1, 2],
        sweep_gammas=[1, 2],
    )
    rows = run_eval(cfg, router_loader=lambda path: FixedRouter("generic", "code", cut=0))["rows"]
    expected = {("autoregressive", 0, 1), ("autoregressive", 0, 2), (chooser, 2, 1), (chooser, 2, 2)}
    assert {(r["method"], r["gamma"], r["batch_size"]) for r in rows} == expected | (
        {(chooser, 1, 1)} if chooser == "routed" else set()
    )
    assert all(r["exact_match"] == 1.0 for r in rows)
    # autoregressive at each batch size (its own rows: the only method asked for), the router taking
    # its turns beside it at both and in the gamma sweep; the oracle picks from its two candidates'
    # runs at batch 1 (run apart: their rows were not asked for) and takes turns at batch 2
    if chooser == "routed":
        assert turns == [(1, ["autoregressive", "routed"]), (2, ["autoregressive", "routed"]), (1, ["routed"])]
    else:
        assert turns == [(1, ["autoregressive"]), (2, ["autoregressive", "oracle"])]
    assert sorted(batched) == ([1, 1] if chooser == "oracle" else [])


@pytest.mark.parametrize("cheap", ["generic", "specialized:code"])
def test_the_oracle_weighs_tokens_per_pass_by_what_a_pass_costs(tiny_setup, cheap: str, monkeypatch) -> None:
    """The oracle picks per prompt from tau over the measured pass cost: a drafter whose passes
    cost 100 target steps is never picked, whatever its tau."""
    tmp_path, folders = tiny_setup
    timed = []

    def pass_costs(target, drafters, gammas, context, repeats=3):
        timed.append(dict(gammas))
        return {name: 1.0 if name == cheap else 100.0 for name in drafters}

    monkeypatch.setattr(suite, "measure_pass_costs", pass_costs)
    cfg = routed_config(
        tmp_path,
        folders,
        methods=["autoregressive", "generic", "specialized", "routed", "oracle"],
        domains=["code", "math"],
        prompts_per_domain=3,
        max_new_tokens=8,
        temperatures=[0.0],
        batch_sizes=[1],
    )
    results = run_eval(cfg, router_loader=lambda path: FixedRouter("generic", "generic"))
    rows = {(r["domain"], r["method"]): r for r in results["rows"]}
    for domain, routing_s in results["routing_seconds_per_prompt"].items():
        # the router's choices (generic throughout) on the generic drafter's own run, plus routing
        assert rows[(domain, "routed_choices")]["seconds"] == pytest.approx(
            rows[(domain, "generic")]["seconds"] + 3 * routing_s
        )
    assert timed == [{"generic": 2, "specialized:code": 2}]  # once per evaluation, at the gamma decoded
    assert rows[("code", "generic")]["tau"] != rows[("code", "specialized:code")]["tau"]  # the choice matters
    for domain in ("code", "math"):
        assert rows[(domain, "oracle")]["tau"] == rows[(domain, cheap)]["tau"]
        assert rows[(domain, "oracle")]["exact_match"] == 1.0


def test_no_share_where_a_drafter_chosen_from_has_no_rows(tiny_setup, monkeypatch) -> None:
    """The router and the oracle choose between every trained drafter; where one has no rows of its
    own (its method not asked for), the best single drafter is unknown and no share is given."""
    tmp_path, folders = tiny_setup
    monkeypatch.setattr(
        suite, "measure_pass_costs", lambda target, drafters, gammas, context, repeats=3: dict.fromkeys(drafters, 1.0)
    )
    cfg = routed_config(
        tmp_path,
        folders,
        methods=["autoregressive", "generic", "routed", "oracle"],
        domains=["code"],
        prompts_per_domain=2,
        max_new_tokens=4,
        temperatures=[0.0],
        batch_sizes=[1],
    )
    results = run_eval(cfg, router_loader=lambda path: FixedRouter("code", "code"))
    assert {r["method"] for r in results["rows"]} == {"autoregressive", "generic", "routed", "oracle", "routed_choices"}
    assert results["router_share"] == []


def test_methods_take_turns_batch_by_batch_so_drift_biases_none() -> None:
    """Two identical methods on a machine that slows down during the run: taking turns, each gets
    its own batches' sequences and about the same speed; one after the other, the second would
    look ~30% slower."""
    clock = [0]

    def method(name: str) -> Any:
        def generate(batch: list[list[int]]) -> GenerationResult:
            clock[0] += 1
            counters = StepCounters(0, torch.device("cpu"))
            counters.record_target_call(len(batch))
            # the machine's speed halves over the run: call k takes 1 + k / 8 seconds
            return GenerationResult.build([[len(p), ord(name)] for p in batch], counters, 1.0 + clock[0] / 8)

        return generate

    prompts = [[1] * n for n in range(1, 9)]
    calls: list[str] = []
    generators = {
        name: (lambda fn, name: lambda batch: calls.append(name) or fn(batch))(method(name), name)
        for name in ("a", "b")
    }
    records = run_interleaved(generators, prompts, batch_size=3)
    assert calls == ["a", "b", "b", "a", "a", "b"]  # turn k starts at the k-th method: none always runs last
    assert [len(r.sequences) for r in records["a"].results] == [3, 3, 2]
    assert records["a"].sequences == [[n, ord("a")] for n in range(1, 9)]
    assert records["b"].sequences == [[n, ord("b")] for n in range(1, 9)]
    speed = {name: record.tokens / record.seconds for name, record in records.items()}
    assert speed["b"] == pytest.approx(speed["a"], rel=0.15)
    clock[0] = 0
    one_after_the_other = {name: run_batched(fn, prompts, 3) for name, fn in generators.items()}
    assert one_after_the_other["a"].seconds < 0.8 * one_after_the_other["b"].seconds  # what the turns avoid


def test_a_routed_method_takes_its_turns_too() -> None:
    """The router's choices decode beside the methods that run every prompt, turn by turn (its row
    once ran after theirs and lost a third of its speed to the machine's drift): at batch 1 in
    prompt order, at batch 2 grouped by choice, sequences back in prompt order either way."""
    calls: list[tuple[str, int]] = []

    def method(name: str) -> Any:
        def generate(batch: list[list[int]]) -> GenerationResult:
            calls.append((name, len(batch)))
            counters = StepCounters(0, torch.device("cpu"))
            counters.record_target_call(len(batch))
            return GenerationResult.build([[len(p), ord(name)] for p in batch], counters, float(len(calls)))

        return generate

    prompts = [[1] * n for n in range(1, 5)]
    pool = {name: method(name) for name in ("a", "b", "x")}
    choices = ["b", "a", "b", "a"]
    records = run_interleaved({"x": pool["x"]}, prompts, 1, chosen={"routed": choices}, pool=pool)
    assert calls == [("x", 1), ("b", 1), ("a", 1), ("x", 1), ("x", 1), ("b", 1), ("a", 1), ("x", 1)]
    assert records["routed"].sequences == [[n, ord(c)] for n, c in zip(range(1, 5), choices)]
    assert records["x"].sequences == [[n, ord("x")] for n in range(1, 5)]
    calls.clear()
    records = run_interleaved({"x": pool["x"]}, prompts, 2, chosen={"routed": choices}, pool=pool)
    assert calls == [("x", 2), ("b", 2), ("a", 2), ("x", 2)]
    assert records["routed"].sequences == [[n, ord(c)] for n, c in zip(range(1, 5), choices)]
    with pytest.raises(ValueError, match=r"\['c'\]"):
        run_interleaved({}, prompts, 1, chosen={"routed": ["a", "c", "a", "a"]}, pool=pool)
    with pytest.raises(ValueError, match="3 choices for 4 prompts"):
        run_interleaved({}, prompts, 1, chosen={"routed": ["a", "a", "a"]}, pool=pool)


def test_gamma_sweep_rows_for_the_swept_methods_only(tiny_setup) -> None:
    tmp_path, folders = tiny_setup
    cfg = routed_config(
        tmp_path,
        folders,
        methods=["autoregressive", "generic", "specialized", "routed", "oracle"],
        domains=["code"],
        prompts_per_domain=2,
        max_new_tokens=6,
        temperatures=[0.0, 1.0],
        batch_sizes=[1, 2],
        sweep_gammas=[1, 2, 3],
        sweep_temperatures=[0.0, 1.0],
    )
    results = run_eval(cfg, router_loader=lambda path: FixedRouter("generic", "code"))
    rows = results["rows"]
    # the router's share is of the main gamma's rows, not the sweep's
    assert results["router_share"] == router_share([r for r in rows if r["gamma"] in (0, 2)])
    assert all(share["routed_speedup"] is not None for share in results["router_share"])
    gammas = {}
    for r in rows:
        gammas.setdefault((r["method"], r["temperature"], r["batch_size"]), set()).add(r["gamma"])
    for temperature in (0.0, 1.0):
        # Swept at the smallest batch size; the main gamma (2) ran once, not twice.
        assert gammas[("generic", temperature, 1)] == gammas[("routed", temperature, 1)] == {1, 2, 3}
        assert gammas[("generic", temperature, 2)] == gammas[("specialized:code", temperature, 1)] == {2}
        assert gammas[("autoregressive", temperature, 1)] == {0}
    assert len(rows) == len({(r["method"], r["temperature"], r["batch_size"], r["gamma"]) for r in rows})
    for r in rows:
        if r["temperature"] == 0.0:
            assert r["exact_match"] == 1.0, r  # sweep rows are checked against target greedy too
        if r["method"] != "autoregressive":
            assert len(r["position_acceptance"]) == r["gamma"], r


def test_gamma_auto_rows_sit_beside_the_fixed_gammas_of_the_sweep(tiny_setup, monkeypatch) -> None:
    """gamma=auto: every drafter decodes with its adaptive gamma (here from a stand-in step table),
    exact, its rows keyed `auto`; the sweep's fixed gammas run beside it."""
    tmp_path, folders = tiny_setup
    table = StepTable((1, 2), ((1.0, 1.1, 1.2, 1.3), (1.0, 1.2, 1.4, 1.6)), 16)
    asked: list[float] = []

    def stand_in(target, drafter, params):
        asked.append(params.temperature)
        return AdaptiveGamma(table)

    monkeypatch.setattr(suite, "adaptive_gamma", stand_in)
    cfg = routed_config(
        tmp_path,
        folders,
        methods=["autoregressive", "generic", "routed"],
        domains=["code"],
        prompts_per_domain=2,
        max_new_tokens=8,
        temperatures=[0.0, 1.0],
        batch_sizes=[1, 2],
        sweep_gammas=[1, 2],
        gamma="auto",
    )
    results = run_eval(cfg, router_loader=lambda path: FixedRouter("generic", "code"))
    rows = results["rows"]
    auto = [r for r in rows if r["gamma"] == "auto"]
    assert {(r["method"], r["temperature"], r["batch_size"]) for r in auto} == {
        (m, t, b) for m in ("generic", "routed") for t in (0.0, 1.0) for b in (1, 2)
    }
    assert all(r["exact_match"] == 1.0 for r in auto if r["temperature"] == 0.0)
    assert {r["gamma"] for r in rows if r["method"] == "generic" and r["batch_size"] == 1} == {"auto", 1, 2}
    assert set(asked) == {0.0, 1.0}  # one adaptive gamma per drafter and temperature
    assert "| code | generic | auto |" in (tmp_path / "eval" / "report.md").read_text()


def test_batch1_prompts_decodes_the_first_prompts_at_batch_1_and_all_at_larger_batches(tiny_setup) -> None:
    tmp_path, folders = tiny_setup
    cfg = routed_config(
        tmp_path,
        folders,
        methods=["autoregressive", "generic", "specialized", "routed", "oracle"],
        domains=["code"],
        prompts_per_domain=3,
        batch1_prompts=2,
        max_new_tokens=5,
        temperatures=[0.0],
        batch_sizes=[1, 3],
        sweep_gammas=[1, 2],
    )
    rows = run_eval(cfg, router_loader=lambda path: FixedRouter("generic", "code"))["rows"]
    prompts = {(r["method"], r["batch_size"], r["gamma"]): r["prompts"] for r in rows}
    assert prompts[("autoregressive", 1, 0)] == prompts[("routed", 1, 2)] == prompts[("oracle", 1, 2)] == 2
    assert prompts[("generic", 1, 1)] == prompts[("routed", 1, 1)] == 2  # the sweep runs at batch 1
    assert prompts[("autoregressive", 3, 0)] == prompts[("routed", 3, 2)] == prompts[("generic", 3, 2)] == 3
    # the oracle's choices come from batch-1 runs: none cover the third prompt, so no oracle at batch 3
    assert ("oracle", 3, 2) not in prompts
    assert all(r["max_new_tokens"] == 5 and r["exact_match"] == 1.0 for r in rows)


def test_the_alldata_control_is_a_row_of_its_own_outside_what_the_router_and_oracle_choose(tiny_setup) -> None:
    """`alldata` (here the generic drafter's own folder) decodes as a method of its own: greedy,
    its rows are the generic drafter's to the token; it is no candidate of the oracle's, nor a
    best single drafter in the router's share."""
    tmp_path, folders = tiny_setup
    cfg = routed_config(
        tmp_path,
        folders | {"alldata": folders["generic"]},
        methods=["autoregressive", "generic", "alldata", "specialized", "routed", "oracle"],
        domains=["code"],
        prompts_per_domain=2,
        max_new_tokens=5,
        temperatures=[0.0],
        batch_sizes=[1],
    )
    results = run_eval(cfg, router_loader=lambda path: FixedRouter("generic", "code"))
    rows = {r["method"]: r for r in results["rows"]}
    assert rows["alldata"]["exact_match"] == 1.0
    assert (rows["alldata"]["alpha"], rows["alldata"]["tokens"]) == (
        rows["generic"]["alpha"],
        rows["generic"]["tokens"],
    )
    assert results["router_share"] and all(s["best_single"] != "alldata" for s in results["router_share"])


@pytest.mark.parametrize("batch1_prompts", [0, 4, 1.5])
def test_bad_batch1_prompts_names_the_value(batch1_prompts) -> None:
    with pytest.raises(ValueError, match=f"batch1_prompts={batch1_prompts}"):
        EvalConfig(methods=["autoregressive"], prompts_per_domain=3, batch1_prompts=batch1_prompts)


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("sweep_gammas", [0], "sweep_gammas=0"),
        ("sweep_methods", ["oracle"], "sweep_methods='oracle'"),
        ("sweep_methods", ["specialized:poetry"], "sweep_methods='specialized:poetry'"),
    ],
)
def test_bad_sweep_names_the_value(field, value, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        EvalConfig(methods=["autoregressive"], **{field: value})


def test_oracle_picks_the_most_tokens_per_unit_of_pass_cost() -> None:
    from types import SimpleNamespace

    def record(taus, per_batch: int = 1):
        return RunRecord([SimpleNamespace(stats=SimpleNamespace(tau=t), sequences=[[0]] * per_batch) for t in taus])  # type: ignore[list-item]

    choices = pick_per_prompt({"generic": record([1.0, 2.0, 1.5]), "specialized:code": record([1.2, 1.0, 1.5])})
    assert choices == ["specialized:code", "generic", "generic"]
    # Longer drafts buy more tokens per pass at a price: per unit of pass cost, the cheaper drafter
    # wins the first prompt back (1.0 / 1.0 > 1.2 / 1.3) and the third (1.5 > 1.6 / 1.3)
    costs = {"generic": 1.0, "specialized:code": 1.3}
    choices = pick_per_prompt({"generic": record([1.0, 2.0, 1.5]), "specialized:code": record([1.2, 1.0, 1.6])}, costs)
    assert choices == ["generic", "generic", "generic"]
    assert pick_per_prompt(
        {"generic": record([1.0]), "specialized:code": record([2.0])}, {"generic": 1.0, "specialized:code": 1.9}
    ) == ["specialized:code"]
    with pytest.raises(ValueError, match="specialized:code"):
        pick_per_prompt({"generic": record([1.0]), "specialized:code": record([2.0])}, {"generic": 1.0})
    # a chooser's row is prompt i's result from its choice's run, plus its own seconds
    pool = {"generic": record([1.0, 2.0, 1.5]), "specialized:code": record([1.2, 1.0, 1.6])}
    row = composed(pool, ["specialized:code", "generic", "specialized:code"], extra_seconds=0.5)
    assert [r.stats.tau for r in row.results] == [1.2, 2.0, 1.6] and row.extra_seconds == 0.5
    with pytest.raises(ValueError, match=r"\['autoregressive'\]"):
        composed(pool, ["generic", "autoregressive", "generic"])
    # only batch-1 runs of the chosen prompts, in their order, compose: anything else would mismatch prompts
    for bad in (
        record([1.0, 2.0], per_batch=2),
        record([1.0, 2.0]),
        RunRecord(record([1.0, 2.0, 1.5]).results, order=[2, 1, 0]),
    ):
        with pytest.raises(ValueError, match="pool\\['generic'\\] is no batch-1 run of the 3 prompts"):
            composed(pool | {"generic": bad}, ["specialized:code", "generic", "specialized:code"])


def test_router_share_is_its_gain_over_the_best_single_drafter_out_of_the_oracles() -> None:
    """(routed − best single) / (oracle − best single) on speedups averaged over domains, per
    temperature and batch size; None where the oracle gains nothing; settings without an oracle
    are skipped. Figures chosen so that a per-domain or unaveraged share would differ."""

    def row(domain: str, method: str, speedup: float, temperature: float = 0.0, batch: int = 1) -> dict:
        return {"domain": domain, "method": method, "speedup": speedup, "temperature": temperature, "batch_size": batch}

    speedups = {  # (code, math): generic averages 1.3, code 1.35 (the best single), oracle 1.55, routed 1.5
        "autoregressive": (1.0, 1.0),
        "generic": (1.2, 1.4),
        "specialized:code": (1.6, 1.1),
        "oracle": (1.7, 1.4),
        "routed": (1.6, 1.4),
        "routed_choices": (1.65, 1.4),
    }
    rows = [row(d, m, v[i]) for m, v in speedups.items() for i, d in enumerate(("code", "math"))]
    rows += [
        row(d, m, 1.2, temperature=0.7)
        for m in ("autoregressive", "generic", "oracle", "routed")
        for d in ("code", "math")
    ]
    rows += [row(d, m, 1.2, batch=4) for m in ("autoregressive", "generic", "routed") for d in ("code", "math")]
    first, flat = router_share(rows)
    assert (first["temperature"], first["batch_size"], first["best_single"]) == (0.0, 1, "specialized:code")
    assert first["best_single_speedup"] == pytest.approx(1.35) and first["oracle_speedup"] == pytest.approx(1.55)
    assert first["routed_share"] == pytest.approx(0.75) and first["routed_choices_share"] == pytest.approx(0.875)
    assert (flat["temperature"], flat["routed_share"]) == (0.7, None) and "routed_choices_share" not in flat
    # named, the drafters chosen between decide the settings: T = 0.7 has no code specialist's rows
    assert router_share(rows, ["generic", "specialized:code"]) == [first]
    # an oracle below the best single drafter leaves nothing to recover
    below = [r | {"speedup": 1.0} if r["method"] == "oracle" else r for r in rows]
    assert router_share(below)[0]["routed_share"] is None
    # a drafter the router chooses from without rows of its own: the best single drafter is unknown
    assert router_share(rows, ["generic", "specialized:code", "specialized:math"]) == []
    # a single drafter missing a domain (or a speedup) is no candidate when none are named, and
    # leaves its setting without a share when it is named
    gap = [r for r in rows if (r["method"], r["domain"], r["temperature"]) != ("specialized:code", "math", 0.0)]
    partial = router_share(gap)[0]
    assert partial["best_single"] == "generic" and partial["routed_share"] == pytest.approx((1.5 - 1.3) / (1.55 - 1.3))
    assert router_share(gap, ["generic", "specialized:code"]) == []
    unknown = [
        r | {"speedup": None} if (r["method"], r["domain"], r["temperature"]) == ("oracle", "math", 0.0) else r
        for r in rows
    ]
    assert router_share(unknown) == [flat]  # not an oracle at (1.7 + 0) / 2
    # no router row (an oracle alone): no share to give
    assert router_share([r for r in rows if r["method"] not in ("routed", "routed_choices")]) == []


def test_share_table_marks_missing_shares_and_tags_merged_runs(tmp_path) -> None:
    """report.md's share table: a dash where a chooser has no row or no gain to share, and a gamma
    column for the shares of several runs (`merge_results`, e.g. a multirun over gamma)."""
    from specdecode.evaluation.report import share_table

    share = {
        "temperature": 0.0,
        "batch_size": 1,
        "best_single": "generic",
        "best_single_speedup": 1.3,
        "oracle_speedup": 1.5,
        "routed_speedup": 1.45,
        "routed_share": 0.75,
    }
    table = share_table([share, share | {"temperature": 0.7, "routed_share": None}])
    assert table.splitlines()[2] == "| 0.0 | 1 | generic 1.300× | 1.500× | 1.450× (75%) | – |"
    assert table.splitlines()[3].endswith("| 1.450× (–) | – |")
    for gamma in (1, 2):
        folder = tmp_path / f"gamma={gamma}"
        folder.mkdir()
        data = {"rows": [], "config": {"gamma": gamma}, "router_share": [share | {"routed_share": gamma / 4}]}
        (folder / "results.json").write_text(json.dumps(data))
    merged = merge_results(tmp_path.glob("*/results.json"))
    assert [(s["gamma"], s["routed_share"]) for s in merged["router_share"]] == [(1, 0.25), (2, 0.5)]
    lines = share_table(merged["router_share"]).splitlines()
    assert (
        lines[0].startswith("| gamma | T | batch |") and lines[3].startswith("| 2 | 0.0 | 1 |") and "(50%)" in lines[3]
    )


def test_merged_counts_sum_work_and_take_the_slowest_process_time() -> None:
    a = dict(
        tokens=10,
        seconds=2.0,
        accepted=3,
        rejections=1,
        row_calls=5.0,
        reached=[4, 3],
        passed=[3, 1],
        prompts=2,
        matches=2,
    )
    b = dict(
        tokens=6,
        seconds=3.0,
        accepted=1,
        rejections=1,
        row_calls=4.0,
        reached=[2, 1],
        passed=[1, 0],
        prompts=1,
        matches=1,
    )
    merged = merge_counts([a, b])
    assert merged["tokens"] == 16 and merged["seconds"] == 3.0 and merged["matches"] == 3
    assert merged["reached"] == [6, 4] and merged["passed"] == [4, 1]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(methods=["autoregressive", "telepathy"]), "telepathy"),
        (dict(methods=["generic"]), "autoregressive"),
        (dict(methods=["autoregressive", "generic"]), "drafters.generic"),
        (dict(methods=["autoregressive", "alldata"]), "drafters.alldata"),
        (dict(methods=["autoregressive", "routed"]), "router_dir"),
        (dict(methods=["autoregressive", "oracle"], batch_sizes=[2]), "batch_sizes"),
        (dict(methods=["autoregressive"], sweep_gammas=[1, 2]), "gamma=None"),
        (dict(methods=["autoregressive"], domains=["poetry"]), "poetry"),
        (dict(methods=["autoregressive"], drafters={"code": "/no/such/folder"}), "/no/such/folder"),
        (dict(methods=["autoregressive"], batch_sizes=[0]), "batch_sizes"),
        (dict(methods=["autoregressive"], gamma=65), "gamma=65"),
        (dict(methods=["autoregressive"], gamma="fast"), "gamma='fast'"),
        (dict(methods=["autoregressive"], temperatures=[float("nan")]), "temperatures=nan"),
    ],
)
def test_bad_eval_config_names_the_field(kwargs, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        EvalConfig(**kwargs)


@pytest.mark.parametrize("enabled", [True, False])
def test_every_drafter_decodes_with_the_configured_prompt_lookup(tiny_setup, monkeypatch, enabled) -> None:
    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs["prompt_lookup"])
        return speculative_generate(*args, **kwargs)

    monkeypatch.setattr(suite, "speculative_generate", recording)
    tmp_path, folders = tiny_setup
    lookup = PromptLookup(enabled=enabled, max_ngram=3, min_ngram=1, max_confidence=0.5)
    cfg = EvalConfig(
        target=TargetConfig(name=str(tmp_path / "target")),
        drafters=folders,
        router_dir="unused",
        domains=["code"],
        methods=["autoregressive", "generic", "specialized", "routed"],
        prompts_per_domain=2,
        max_new_tokens=4,
        gamma=2,
        prompt_lookup=lookup,
        temperatures=[0.0],
        batch_sizes=[1],
        output_dir=str(tmp_path / "eval"),
    )
    run_eval(cfg, router_loader=lambda path: FixedRouter("generic", "code"))
    assert seen and all(s == PromptLookup(enabled=enabled, max_ngram=3, min_ngram=1, max_confidence=0.5) for s in seen)


def test_merge_results_of_a_gamma_sweep(tmp_path) -> None:
    for gamma in (1, 2):
        folder = tmp_path / f"gamma={gamma}"
        folder.mkdir()
        (folder / "results.json").write_text(json.dumps({"rows": [{"gamma": gamma}], "config": {}, "date": "d"}))
    merged = merge_results(tmp_path.glob("*/results.json"))
    assert [r["gamma"] for r in merged["rows"]] == [1, 2]
    with pytest.raises(ValueError, match="no results"):
        merge_results([])


def test_every_method_decodes_once_untimed_before_the_first_timed_run(tiny_setup, monkeypatch) -> None:
    """A process's first decodes pay one-off costs (CUDA's start, the first pass at each width): each
    method warms up on one prompt, with room for two verifies of its gamma, before any timed turn."""
    tmp_path, folders = tiny_setup
    calls: list[tuple[str, int]] = []

    def recording(real, label):
        def run(*args, **kwargs):
            drafter = args[1] if label == "speculative" else None
            calls.append((label if drafter is None else f"{label}:{id(drafter)}", kwargs["max_new_tokens"]))
            return real(*args, **kwargs)

        return run

    monkeypatch.setattr(suite, "autoregressive_generate", recording(suite.autoregressive_generate, "autoregressive"))
    monkeypatch.setattr(suite, "speculative_generate", recording(suite.speculative_generate, "speculative"))
    cfg = EvalConfig(
        target=TargetConfig(name=str(tmp_path / "target")),
        drafters=folders,
        domains=["code", "math"],
        methods=["autoregressive", "generic", "specialized"],
        prompts_per_domain=2,
        max_prompt_tokens=150,
        max_new_tokens=12,
        gamma=2,
        temperatures=[0.0],
        batch_sizes=[1],
        output_dir=str(tmp_path / "eval"),
    )
    results = run_eval(cfg)
    rows = results["rows"]
    # each model's CPU kernels, as picked in this process (conftest pins the picks to plain)
    assert results["cpu_kernels"] == {n: {"skinny_rows": None} for n in ("target", "generic", "specialized:code")}
    warm = calls[:3]
    assert {budget for _, budget in warm} == {2 * 2 + 2} and len({name for name, _ in warm}) == 3
    assert all(budget == 12 for _, budget in calls[3:]) and {n for n, _ in calls[3:]} == {n for n, _ in warm}
    assert all(r["exact_match"] == 1.0 for r in rows)


def test_the_compile_knob_picks_the_evaluations_decode_core() -> None:
    """`compile` null (auto) keeps the eager loop on the CPU and picks the static core under
    torch.compile on CUDA; true or false force it."""
    import torch

    from specdecode.evaluation.config import EvalConfig
    from specdecode.evaluation.suite import _decode

    class Target:
        def __init__(self, device: str) -> None:
            self.device = torch.device(device)

    for setting, device, expected in (
        (None, "cpu", False),
        (None, "cuda", True),
        (True, "cpu", True),
        (False, "cuda", False),
    ):
        cfg = EvalConfig(methods=["autoregressive"], compile=setting, max_prompt_tokens=100, max_new_tokens=64, gamma=3)
        models = suite._Models(target=Target(device), tokenizer=None, eos=[], drafters={"generic": None})
        core = _decode(cfg, models, 0.0, 1, [])
        assert {k: core[k] for k in ("static", "compile")} == {"static": expected, "compile": expected}
        # compiled, one capacity for every decode: the longest prompt + its budget + gamma + 2, rounded up
        assert core.get("capacity") == (256 if expected else None)
    # the widest gamma sets it, a swept one included: 100 + 20 + 8 + 2 slots
    cfg = EvalConfig(methods=["autoregressive"], compile=True, max_prompt_tokens=100, max_new_tokens=20, gamma=3)
    models = suite._Models(target=Target("cpu"), tokenizer=None, eos=[], drafters={"generic": None})
    assert _decode(cfg, models, 0.0, 1, [])["capacity"] == 128
    cfg = EvalConfig(
        methods=["autoregressive"], compile=True, max_prompt_tokens=100, max_new_tokens=20, gamma=3, sweep_gammas=[8]
    )
    assert _decode(cfg, models, 0.0, 1, [])["capacity"] == 256


def test_a_call_that_compiled_decodes_again_and_its_excess_counts_as_compiling(monkeypatch) -> None:
    """Under `compile`, a shape's first decode pays for compiling: the evaluation times a second
    decode of the same prompts instead, and counts the difference as the method's compile seconds."""
    compiled_shapes: set[int] = set()
    calls: list[int] = []
    monkeypatch.setattr(records, "graphs_compiled", lambda: len(compiled_shapes))

    def generate(prompts):
        calls.append(len(prompts))
        seconds = 1.0
        if len(prompts) not in compiled_shapes:  # a new batch size compiles one graph
            compiled_shapes.add(len(prompts))
            seconds = 5.0
        return GenerationResult.build([[7]] * len(prompts), StepCounters(0, torch.device("cpu")), seconds)

    compile_seconds: dict[str, float] = {}
    said: list[str] = []
    settled = records.settled(generate, "generic", compile_seconds, said.append)
    assert settled([[1], [2]]).stats.wall_time_s == 1.0 and calls == [2, 2]
    assert compile_seconds == {"generic": 4.0}
    assert said == ["generic: compiled a decode of 2 prompts in 4.0 s (kept out of its timing)"]
    assert settled([[3], [4]]).stats.wall_time_s == 1.0 and calls == [2, 2, 2]  # a shape seen: once
    settled([[5]])
    assert calls == [2, 2, 2, 1, 1] and compile_seconds == {"generic": 8.0}


@pytest.mark.parametrize("compile", [False, True])
def test_only_compiled_decodes_are_settled_and_filled(compile: bool, monkeypatch) -> None:
    models = suite._Models(target=None, tokenizer=None, eos=[], drafters={"generic": None})
    settled, filled = [], []
    monkeypatch.setattr(suite, "settled", lambda generate, name, seconds, say: settled.append(generate) or name)
    monkeypatch.setattr(suite, "filled", lambda generate, sizes, budget: filled.append((sizes, budget)) or "filled")
    decode = {"max_new_tokens": 4, "static": compile, "compile": compile}
    generators = suite._generators(models, 2, decode, None, [1, 8])
    assert list(generators) == ["autoregressive", "generic"]
    # compiled, each decode is filled, and the filled decode settled
    assert generators == ({"autoregressive": "autoregressive", "generic": "generic"} if compile else generators)
    assert settled == (["filled", "filled"] if compile else [])
    assert filled == ([([1, 8], 4)] * 2 if compile else [])


@pytest.mark.parametrize("kind", ["slice", "target alone"])
@pytest.mark.parametrize("core", ["eager", "static"])
def test_a_filled_batch_decodes_what_the_batch_alone_does(core: str, kind: str) -> None:
    """Compiled, a batch of fewer prompts than a configured batch size is filled up to it with rows
    of no budget (one graph per configured size); in greedy decoding its sequences and stats are
    the batch's own, a row cut short by EOS and prompt lookup's counts included."""
    from specdecode.decoding import autoregressive_generate
    from tests.models_for_tests import tiny_llama
    from tests.test_verify import EAGER_LOOKUP

    target = tiny_llama(2, seed=0)
    drafter = derive_drafter(target, 1)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    seen = []

    def decode(prompts, eos=(), **kwargs):
        seen.append(kwargs.get("max_new_tokens", 10))
        kwargs = {"max_new_tokens": 10, "eos_token_ids": list(eos), "static": core == "static"} | kwargs
        if kind == "target alone":
            return autoregressive_generate(target, prompts, **kwargs)
        return speculative_generate(target, drafter, prompts, gamma=2, prompt_lookup=EAGER_LOOKUP, **kwargs)

    eos = decode(prompts).sequences[1][3]  # cuts row 1 (at least) short
    run = partial(decode, eos=[eos])
    alone = run(prompts)
    ours = records.filled(run, [1, 8], 10)(prompts)
    assert seen[-1] == [10, 10, 10, 0, 0, 0, 0, 0]
    assert ours.sequences == alone.sequences and len(alone.sequences[1]) <= 4
    times = ("wall_time_s", "tokens_per_s")
    assert {k: v for k, v in ours.stats.to_dict().items() if k not in times} == {
        k: v for k, v in alone.stats.to_dict().items() if k not in times
    }
    assert kind == "target alone" or alone.stats.looked_up > 0
    records.filled(run, [1, 8], 10)(prompts[:1])
    assert seen[-1] == 10  # batch 1 is a configured size: no filling


def test_a_compiled_evaluation_fills_no_batch_past_its_prompts() -> None:
    cfg = EvalConfig(methods=["autoregressive"], batch_sizes=[1, 8, 64])
    assert suite._batch_shapes(cfg, [[1]] * 10) == [1, 8, 10]
    assert suite._batch_shapes(cfg, [[1]] * 3) == [1, 3]


@pytest.mark.slow  # compiles each method's graphs for each batch shape (minutes on a CPU)
def test_a_compiled_evaluation_reports_compile_seconds_apart_from_its_rows(tiny_setup, monkeypatch) -> None:
    """Compiled, decodes run at the configured batch sizes only (5 prompts at batch 4: 4, then 1
    filled up to 4), their compiling kept out of the rows' times."""
    tmp_path, folders = tiny_setup
    sizes = set()
    for name in ("autoregressive_generate", "speculative_generate"):
        decode = getattr(suite, name)
        spy = lambda *args, decode=decode, **kwargs: sizes.add(len(args[-1])) or decode(*args, **kwargs)  # noqa: E731
        monkeypatch.setattr(suite, name, spy)
    cfg = EvalConfig(
        target=TargetConfig(name=str(tmp_path / "target")),
        drafters={"generic": folders["generic"]},
        domains=["code"],
        methods=["autoregressive", "generic"],
        prompts_per_domain=5,
        max_prompt_tokens=150,
        max_new_tokens=8,
        gamma=2,
        temperatures=[0.0],
        batch_sizes=[1, 4],
        compile=True,
        output_dir=str(tmp_path / "eval"),
    )
    results = run_eval(cfg)
    assert sizes == {1, 4}
    assert set(results["compile_seconds"]) == {"autoregressive", "generic"}
    assert all(seconds > 0 for seconds in results["compile_seconds"].values())
    assert all(r["exact_match"] == 1.0 for r in results["rows"])
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["compile_seconds"] == results["compile_seconds"]
    assert "seconds spent compiling" in (tmp_path / "eval" / "report.md").read_text()


def test_the_report_says_what_compiling_cost_where_a_core_compiled(tmp_path) -> None:
    from specdecode.evaluation.report import compile_lines

    assert compile_lines({}) == []
    line = compile_lines({"autoregressive": 41.25, "generic": 63.0})[0]
    assert "autoregressive 41.2 s, generic 63.0 s" in line and "kept out of the rows' times" in line


def test_a_decode_that_compiles_again_when_repeated_is_named(monkeypatch) -> None:
    compiled = []
    monkeypatch.setattr(records, "graphs_compiled", lambda: len(compiled))

    def generate(prompts):
        compiled.append(1)  # every call compiles: guards that never hold
        return GenerationResult.build([[7]], StepCounters(0, torch.device("cpu")), 1.0)

    with pytest.warns(UserWarning, match="generic: a decode compiled again when repeated"):
        records.settled(generate, "generic", {})([[1]])


def test_repeated_rounds_start_one_method_further_on_and_keep_the_median_round() -> None:
    calls: list[str] = []

    def method(name: str, seconds: list[float]) -> Any:
        times = iter(seconds)

        def generate(batch: list[list[int]]) -> GenerationResult:
            calls.append(name)
            counters = StepCounters(0, torch.device("cpu"))
            counters.record_target_call(len(batch))
            return GenerationResult.build([[len(calls)] for _ in batch], counters, next(times))

        return generate

    prompts = [[1], [2]]
    generators = {"a": method("a", [1.0, 3.0, 5.0]), "b": method("b", [2.0, 2.0, 2.0])}
    rounds = [run_interleaved(generators, prompts, batch_size=2, first=k) for k in range(3)]
    assert calls == ["a", "b", "b", "a", "a", "b"]  # a single turn per round: the rounds take the places in turn
    kept = records.median_rounds(rounds)
    assert [r["a"].seconds for r in rounds] == [1.0, 3.0, 5.0] and kept["a"] is rounds[1]["a"]
    assert kept["b"].seconds == 2.0 and kept["b"] in [r["b"] for r in rounds]


def test_with_a_baseline_each_method_keeps_its_median_speedup_pair_by_pair() -> None:
    """The machine slows between rounds: pair by pair b runs 0.83x, 2.0x and 1.0x a's speed, so its
    median speedup is 1.0x, where each method's median round alone would say 1.33x."""
    counters = StepCounters(0, torch.device("cpu"))
    counters.record_target_call(1)

    def record(seconds: float) -> RunRecord:
        return RunRecord([GenerationResult.build([[1]], counters, seconds)])

    rounds = [{"a": record(a), "b": record(b)} for a, b in ((10.0, 12.0), (30.0, 15.0), (20.0, 20.0))]
    assert records.median_rounds(rounds)["b"].seconds == 15.0
    kept = records.median_rounds(rounds, baseline="a")
    assert kept["a"].seconds == 20.0 and kept["a"] is rounds[2]["a"]
    assert kept["a"].seconds / kept["b"].seconds == pytest.approx(1.0)
    rounds[2]["b"] = record(40.0)  # 0.5x: the lower of the middle speedups is now 0.83x, carried to a's 20 s
    kept = records.median_rounds(rounds[:2] + rounds[2:], baseline="a")
    assert kept["b"].seconds == pytest.approx(24.0) and kept["b"].results == rounds[0]["b"].results


def test_batched_rounds_repeat_the_turns_past_batch_1_only(tiny_setup, monkeypatch) -> None:
    tmp_path, folders = tiny_setup
    turns: list[tuple[int, int]] = []  # (batch size, first method) of each run where the methods take turns

    def interleaved(*args: Any, first: int = 0, **kwargs: Any) -> dict[str, RunRecord]:
        turns.append((args[2], first))
        return run_interleaved(*args, first=first, **kwargs)

    monkeypatch.setattr(suite, "run_interleaved", interleaved)
    cfg = routed_config(
        tmp_path,
        folders,
        methods=["autoregressive", "generic", "routed"],
        domains=["code"],
        prompts_per_domain=2,
        max_new_tokens=5,
        temperatures=[0.0],
        batch_sizes=[1, 2],
        batched_rounds=3,
    )
    rows = run_eval(cfg, router_loader=lambda path: FixedRouter("generic", "code"))["rows"]
    assert turns == [(1, 0), (2, 0), (2, 1), (2, 2)]
    assert all(r["exact_match"] == 1.0 and r["prompts"] == 2 for r in rows)
    with pytest.raises(ValueError, match="batched_rounds=0: an int >= 1"):
        routed_config(tmp_path, folders, batched_rounds=0)
