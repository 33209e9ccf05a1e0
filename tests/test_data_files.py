"""Tests for local data files (`source: file`): each format read by `datasets.load_dataset`, offline,
with no cache left behind, and the errors that name the file, the line or the columns."""

from __future__ import annotations

import csv
import glob
import json
import socket
from pathlib import Path
from typing import Any

import datasets
import pytest

from specdecode.data import Example, is_heldout, load_domain
from specdecode.data.files import read_data_file


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "\n", encoding="utf-8")


@pytest.fixture
def load_dataset_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Records the arguments of every `datasets.load_dataset` call, still running the real one."""
    calls: list[dict[str, Any]] = []
    real = datasets.load_dataset

    def spy(path: str, *args: Any, **kwargs: Any) -> Any:
        calls.append({"builder": path, **kwargs})
        return real(path, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    return calls


def _write_parquet(path: Path) -> None:
    datasets.Dataset.from_dict(
        {"text": ["a", "b", None, "d"], "label": ["x", None, "z", "w"], "score": [1, 2, 3, 4]}
    ).to_parquet(str(path))


def _write_csv(path: Path, rows: list[list[str]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows(rows)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_each_format_goes_through_load_dataset_and_leaves_no_cache(
    tmp_path: Path, suffix: str, load_dataset_calls: list[dict[str, Any]]
) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    path = folder / f"prompts{suffix}"
    if suffix == ".jsonl":
        _write_jsonl(path, [{"text": "a", "label": "x"}, {"text": "b"}, {"text": "d", "label": "w"}])
    elif suffix == ".csv":
        _write_csv(path, [["text", "label"], ["a", "x"], ["b", ""], ["", "z"], ["d", "w"]])
    else:
        _write_parquet(path)
    examples = load_domain("chat", source="file", path=path, split="all", prompt_column="text", response_column="label")
    assert examples == [Example("a", "x", "chat"), Example("b", None, "chat"), Example("d", "w", "chat")]
    (call,) = load_dataset_calls
    assert call["builder"] == {".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}[suffix]
    assert call["data_files"] == glob.escape(str(path.resolve())) and call["split"] == "train"
    assert call["keep_in_memory"] is True and call["download_config"].local_files_only is True
    # The Arrow table was built in a temporary folder, gone now; nothing was written beside the file.
    assert not Path(call["cache_dir"]).exists()
    assert list(folder.iterdir()) == [path]


def test_reading_a_file_never_opens_a_connection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a network connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    path = tmp_path / "data.jsonl"
    _write_jsonl(path, [{"prompt": "offline"}])
    assert load_domain("code", source="file", path=path, split="all") == [Example("offline", None, "code")]


def test_file_name_with_glob_characters_is_read_as_named(tmp_path: Path) -> None:
    # load_dataset takes data_files as glob patterns; "[v2]" must not match "v2" or "2".
    named = tmp_path / "chat [v2]*.jsonl"
    _write_jsonl(named, [{"prompt": "the named file"}])
    _write_jsonl(tmp_path / "chat 2.jsonl", [{"prompt": "a file the pattern would match"}])
    assert [e.prompt for e in load_domain("chat", source="file", path=named, split="all")] == ["the named file"]


def test_jsonl_file_with_column_mapping(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    rows = [{"q": f"question {i}", "a": f"answer {i}", "extra": i} for i in range(50)]
    rows += [{"q": "", "a": "skipped: empty prompt"}, {"q": "question 0", "a": "duplicate"}]
    _write_jsonl(path, rows)
    examples = load_domain("math", source="file", path=path, split="all", prompt_column="q", response_column="a")
    assert examples == [Example(f"question {i}", f"answer {i}", "math") for i in range(50)]
    prompts_only = load_domain("math", source="file", path=str(path), split="all", prompt_column="q")
    assert all(example.response is None for example in prompts_only)
    train = load_domain("math", source="file", path=path, prompt_column="q", heldout_fraction=0.5)
    assert [e.prompt for e in train] == [e.prompt for e in examples if not is_heldout(e.prompt, 0.5)]


def test_jsonl_column_of_mixed_types_reads_as_text(tmp_path: Path) -> None:
    # Arrow wants one type per column; datasets stores a mixed one as JSON, and a number that is a
    # prompt comes back as its text, as it did when the file was parsed by hand.
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"prompt": 12, "n": 1}\n{"prompt": "twelve", "n": "one"}\n', encoding="utf-8")
    assert [e.prompt for e in load_domain("math", source="file", path=path, split="all")] == [
        "12",
        "twelve",
    ]


def test_csv_file_keeps_text_as_written(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    long_response = "x" * 200_000  # past the csv module's default 128 KiB cell limit
    _write_csv(
        path,
        [
            ["instruction", "output"],
            ['write a loop, "quoted", with commas\nand a newline', "for i in range(3): pass"],
            ["long one", long_response],
            ["no response", ""],
            # Without string columns pandas would read 0.50 as 0.5, 007 as 7 and NA as missing.
            ["007", "0.50"],
            ["NA", "null"],
        ],
    )
    examples = load_domain(
        "code",
        source="file",
        path=path,
        split="all",
        prompt_column="instruction",
        response_column="output",
    )
    assert examples == [
        Example('write a loop, "quoted", with commas\nand a newline', "for i in range(3): pass", "code"),
        Example("long one", long_response, "code"),
        Example("no response", None, "code"),
        Example("007", "0.50", "code"),
        Example("NA", "null", "code"),
    ]


def test_parquet_file_keeps_missing_cells_missing(tmp_path: Path) -> None:
    path = tmp_path / "data.parquet"
    _write_parquet(path)
    examples = load_domain(
        "chat", source="file", path=path, split="all", prompt_column="score", response_column="label"
    )
    assert examples == [
        Example("1", "x", "chat"),
        Example("2", None, "chat"),
        Example("3", "z", "chat"),
        Example("4", "w", "chat"),
    ]


def test_missing_column_names_column_file_and_available_ones(tmp_path: Path) -> None:
    jsonl = tmp_path / "data.jsonl"
    _write_jsonl(jsonl, [{"question": "q", "answer": "a"}])
    named = r"'{}' not found in domain 'math', file '.*{}'; available columns: \['question', 'answer'\]"
    with pytest.raises(ValueError, match=named.format("prompt", r"data\.jsonl")):
        load_domain("math", source="file", path=jsonl)
    with pytest.raises(ValueError, match=r"'solution'.*\['question', 'answer'\]"):
        load_domain("math", source="file", path=jsonl, prompt_column="question", response_column="solution")
    table = tmp_path / "data.csv"
    table.write_text("question,answer\nq,a\n", encoding="utf-8")
    with pytest.raises(ValueError, match=named.format("text", r"data\.csv")):
        load_domain("math", source="file", path=table, prompt_column="text")
    parquet = tmp_path / "data.parquet"
    _write_parquet(parquet)
    with pytest.raises(ValueError, match=r"'prompt'.*\['text', 'label', 'score'\]"):
        load_domain("math", source="file", path=parquet)


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ('{"prompt": "fine"}\n{not json\n', r"bad\.jsonl' line 2 is not JSON"),
        ('{"prompt": "fine"}\n\n["a", "list"]\n', r"bad\.jsonl' line 3 is not a JSON object"),
        ("\n\n", r"bad\.jsonl' holds no JSON object"),
    ],
)
def test_bad_jsonl_is_named_with_its_line(tmp_path: Path, content: str, named: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=named) as raised:
        load_domain("chat", source="file", path=path)
    assert raised.value.__cause__ is not None  # datasets' own error stays chained


def test_unreadable_csv_and_parquet_are_named(tmp_path: Path) -> None:
    table = tmp_path / "broken.csv"
    table.write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match=r"data file '.*broken\.csv' is empty"):
        read_data_file(table)
    parquet = tmp_path / "broken.parquet"
    parquet.write_bytes(b"this is not parquet")
    with pytest.raises(ValueError, match=r"could not read '.*broken\.parquet' as Parquet"):
        read_data_file(parquet)


def test_a_read_restores_the_callers_datasets_settings(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    _write_jsonl(good, [{"prompt": "p"}])
    bad.write_text("{oops\n", encoding="utf-8")
    verbosity = datasets.logging.get_verbosity()
    initially_disabled = datasets.utils.are_progress_bars_disabled()
    for bars_disabled in (False, True):
        if bars_disabled:
            datasets.disable_progress_bars()
        else:
            datasets.enable_progress_bars()
        try:
            read_data_file(good)
            with pytest.raises(ValueError):
                read_data_file(bad)
            assert datasets.utils.are_progress_bars_disabled() is bars_disabled
            assert datasets.logging.get_verbosity() == verbosity
        finally:
            (datasets.disable_progress_bars if initially_disabled else datasets.enable_progress_bars)()


def test_file_without_any_prompt_is_named(tmp_path: Path) -> None:
    path = tmp_path / "empty_prompts.jsonl"
    _write_jsonl(path, [{"prompt": "", "response": "a"}, {"prompt": "   ", "response": "b"}])
    with pytest.raises(ValueError, match=r"empty_prompts.jsonl' holds no row with a non-empty 'prompt'"):
        load_domain("code", source="file", path=path, split="all")
