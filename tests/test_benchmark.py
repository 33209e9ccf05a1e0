"""The benchmark's wiring, end to end on a tiny model saved as a local HF folder (seconds)."""

from __future__ import annotations

import json

import pytest

from specdecode.core.atomic import write_atomic
from specdecode.evaluation.benchmark import report_markdown, run_benchmark
from specdecode.evaluation.benchmark_report import rows_table
from specdecode.evaluation.config import BenchmarkConfig
from specdecode.models.config import DrafterConfig, TargetConfig


@pytest.fixture
def tiny_target_dir(tmp_path, make_tiny_llama, make_tiny_tokenizer):
    folder = tmp_path / "tiny-target"
    make_tiny_llama(num_hidden_layers=2).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


def test_benchmark_runs_and_writes_results(tmp_path, tiny_target_dir) -> None:
    cfg = BenchmarkConfig(
        target=TargetConfig(name=str(tiny_target_dir)),
        drafter=DrafterConfig(num_layers=1, draft_vocab=32),
        gamma=2,
        max_new_tokens=6,
        num_prompts=4,
        max_prompt_tokens=120,
        batch1_prompts=2,
        batch_size=4,
        cost_repeats=1,
        vocab_corpus_docs=5,
        output_dir=str(tmp_path / "out"),
    )
    results = run_benchmark(cfg)

    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert written["rows"] == results["rows"]
    methods = [(r["method"], r["batch_size"]) for r in written["rows"]]
    assert methods == [
        ("target alone", 1),
        ("specdecode", 1),
        ("specdecode, gamma auto", 1),
        ("transformers assisted", 1),
        ("target alone", 4),
        ("specdecode", 4),
        ("specdecode, gamma auto", 4),
    ]
    # gamma auto: its steps' gammas, chosen from the step table it reports (batch 1..8, gamma 0..6)
    auto = [r for r in written["rows"] if r["method"] == "specdecode, gamma auto"]
    assert all(sum(r["gamma_steps"].values()) > 0 for r in auto)
    assert written["step_table"]["batch_sizes"] == [1, 2, 4, 8] and len(written["step_table"]["seconds"][0]) == 7
    # Greedy decoding must reproduce target-only greedy, in our loop and in transformers'.
    assert all(r["exact_match"] == 1.0 for r in written["rows"])
    assert written["step_costs"]["cost_ratio"] > 0
    assert list(written["step_costs"]["verify_ratios"]) == [str(g) for g in range(1, 9)]
    assert all(r > 0 for r in written["step_costs"]["verify_ratios"].values())
    assert [p["domain"] for p in written["prompts"]] == ["code", "math", "chat", "code"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert report == report_markdown(written) and "loop efficiency" in report and "gamma 8: " in report
    assert "Step cost in target steps" in report and "| 8 | 1.00 |" in report


def test_write_atomic_leaves_old_file_on_failure(tmp_path, monkeypatch) -> None:
    path = tmp_path / "results.json"
    write_atomic(path, "old")

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("specdecode.core.atomic.os.replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_the_report_table_shows_the_columns_some_row_fills() -> None:
    rows = [
        {"method": "a", "batch_size": 1, "tokens_per_s": 10.0, "tau": None, "alpha": None},
        {"method": "b", "batch_size": 1, "tokens_per_s": 20.0, "tau": 2.5, "alpha": None},
    ]
    assert rows_table(rows) == [
        "| batch size | method | tokens per s | tau |",
        "|---|---|---|---|",
        "| 1 | a | 10.0 | – |",
        "| 1 | b | 20.0 | 2.50 |",
    ]


def test_bad_rounds_are_named() -> None:
    with pytest.raises(ValueError, match=r"rounds=-1: an int >= 0"):
        BenchmarkConfig(rounds=-1)
