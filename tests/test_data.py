"""Tests for the domain prompt datasets: embedded sources, the hash split, files, bad inputs."""

from __future__ import annotations

import ast
import csv
import json
import random
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from specdecode.data.domains import (
    DOMAINS,
    Example,
    _iter_truncated_json_array,
    format_prompt,
    heldout_score,
    is_heldout,
    load_domain,
    split_examples,
)


@pytest.mark.parametrize("domain", DOMAINS)
def test_embedded_domain_has_examples_with_expected_fields(domain: str) -> None:
    examples = load_domain(domain, split="all")
    assert len(examples) > 1000
    assert all(isinstance(example, Example) for example in examples)
    assert all(example.domain == domain and example.prompt.strip() for example in examples)
    assert len({example.prompt for example in examples}) == len(examples)  # deduplicated
    with_response = [example for example in examples if example.response is not None]
    assert len(with_response) > 0.99 * len(examples)


def test_embedded_contents() -> None:
    code = load_domain("code", split="all")
    assert code[0].prompt.startswith(
        "from typing import List\n\n\ndef has_close_elements("
    )  # HumanEval/0
    stdlib = [example for example in code if example.prompt.startswith(("def ", "async def ", "@"))]
    assert len(stdlib) > 500
    for example in stdlib:
        # The prompt is itself a complete function whose body is just its docstring, and the
        # prompt followed by the response is the original function.
        (prompt_function,) = ast.parse(example.prompt).body
        assert ast.get_docstring(prompt_function, clean=False) is not None
        assert len(prompt_function.body) == 1
        (whole_function,) = ast.parse(example.prompt + example.response).body
        assert len(whole_function.body) > 1
    math = load_domain("math", split="all")
    assert len(math) == 1319
    assert math[0].prompt.startswith("Janet’s ducks lay 16 eggs per day.")
    assert all("####" in example.response for example in math)
    chat = load_domain("chat", split="all")
    assert all(len(example.prompt) <= 4000 for example in chat)


@pytest.mark.parametrize("domain", DOMAINS)
def test_embedded_split_is_deterministic_disjoint_and_covering(domain: str) -> None:
    train = load_domain(domain, split="train")
    heldout = load_domain(domain, split="heldout")
    everything = load_domain(domain, split="all")
    assert load_domain(domain, split="train") == train
    train_prompts, heldout_prompts = {e.prompt for e in train}, {e.prompt for e in heldout}
    assert not train_prompts & heldout_prompts
    assert train_prompts | heldout_prompts == {e.prompt for e in everything}
    assert 0.05 < len(heldout) / len(everything) < 0.15
    assert load_domain(domain, split="heldout", limit=7) == heldout[:7]


def _examples(count: int, domain: str = "chat") -> list[Example]:
    return [
        Example(prompt=f"prompt number {index}", response=f"r{index}", domain=domain)
        for index in range(count)
    ]


def test_split_is_stable_under_reordering_and_deduplicates() -> None:
    examples = _examples(500)
    shuffled = examples[::-1] + examples[:50]  # reordered, with duplicates
    random.Random(0).shuffle(shuffled)
    for split in ("train", "heldout", "all"):
        forward = split_examples(examples, split, 0.2)
        reordered = split_examples(shuffled, split, 0.2)
        assert sorted(e.prompt for e in forward) == sorted(e.prompt for e in reordered)
        assert len({e.prompt for e in reordered}) == len(reordered)
    heldout = split_examples(examples, "heldout", 0.2)
    assert [e.prompt for e in heldout] == [e.prompt for e in examples if is_heldout(e.prompt, 0.2)]
    assert 60 < len(heldout) < 140


def test_heldout_membership_depends_on_prompt_only() -> None:
    # The same prompt lands on the same side whichever domain or response it comes with, and
    # growing the fraction only moves prompts into the held-out side.
    for example in _examples(200):
        assert 0.0 <= heldout_score(example.prompt) < 1.0
        relabelled = Example(example.prompt, None, "code")
        in_heldout = is_heldout(example.prompt, 0.3)
        assert (split_examples([example], "heldout", 0.3) != []) == in_heldout
        assert (split_examples([relabelled], "heldout", 0.3) != []) == in_heldout
        if is_heldout(example.prompt, 0.1):
            assert is_heldout(example.prompt, 0.3)
    # A fixed value pins the hash itself: changing it would silently move prompts between splits.
    assert heldout_score("What is the capital of France?") == pytest.approx(
        0.06763134212117156, abs=0
    )
    assert heldout_score("\ud83d lone surrogate") >= 0.0  # scraped text must not crash the hash


def test_first_duplicate_wins() -> None:
    first = Example("same", "one", "chat")
    second = Example("same", "two", "chat")
    assert split_examples([first, second], "all") == [first]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "\n", encoding="utf-8")


def test_jsonl_file_with_column_mapping(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    rows = [{"q": f"question {i}", "a": f"answer {i}", "extra": i} for i in range(50)]
    rows += [{"q": "", "a": "skipped: empty prompt"}, {"q": "question 0", "a": "duplicate"}]
    _write_jsonl(path, rows)
    examples = load_domain(
        "math", source="file", path=path, split="all", prompt_column="q", response_column="a"
    )
    assert examples == [Example(f"question {i}", f"answer {i}", "math") for i in range(50)]
    prompts_only = load_domain(
        "math", source="file", path=str(path), split="all", prompt_column="q"
    )
    assert all(example.response is None for example in prompts_only)
    train = load_domain("math", source="file", path=path, prompt_column="q", heldout_fraction=0.5)
    assert [e.prompt for e in train] == [
        e.prompt for e in examples if not is_heldout(e.prompt, 0.5)
    ]


def test_csv_file_with_column_mapping(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    long_response = "x" * 200_000  # past csv's default 128 KiB cell limit
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["instruction", "output"])
        writer.writerow(
            ['write a loop, "quoted", with commas\nand a newline', "for i in range(3): pass"]
        )
        writer.writerow(["long one", long_response])
        writer.writerow(["no response", ""])
    examples = load_domain(
        "code",
        source="file",
        path=path,
        split="all",
        prompt_column="instruction",
        response_column="output",
    )
    assert examples == [
        Example(
            'write a loop, "quoted", with commas\nand a newline', "for i in range(3): pass", "code"
        ),
        Example("long one", long_response, "code"),
        Example("no response", None, "code"),
    ]
    assert csv.field_size_limit() == 131072  # the process-wide limit was restored


def test_parquet_file(tmp_path: Path) -> None:
    pandas = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    path = tmp_path / "data.parquet"
    pandas.DataFrame({"text": ["a", "b", None], "label": ["x", None, "z"]}).to_parquet(path)
    examples = load_domain(
        "chat", source="file", path=path, split="all", prompt_column="text", response_column="label"
    )
    assert examples == [Example("a", "x", "chat"), Example("b", None, "chat")]


def test_hf_source_uses_load_dataset_with_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []

    class FakeDataset(list):
        column_names = ["question", "answer"]

    def load_dataset(hf_id: str, split: str) -> FakeDataset:
        calls.append((hf_id, split))
        return FakeDataset(
            [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}]
        )

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    examples = load_domain(
        "math",
        source="hf",
        hf_id="org/gsm",
        hf_split="test",
        split="all",
        prompt_column="question",
        response_column="answer",
    )
    assert calls == [("org/gsm", "test")]
    assert examples == [Example("1+1?", "2", "math"), Example("2+2?", "4", "math")]
    with pytest.raises(ValueError, match=r"'prompt'.*\['question', 'answer'\]"):
        load_domain("math", source="hf", hf_id="org/gsm", split="all")


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"domain": "poetry"}, ValueError, "'poetry'"),
        ({"source": "s3"}, ValueError, "'s3'"),
        ({"split": "validation"}, ValueError, "'validation'"),
        ({"heldout_fraction": 0.0}, ValueError, "0.0"),
        ({"heldout_fraction": 1.0}, ValueError, "1.0"),
        ({"heldout_fraction": -0.5}, ValueError, "-0.5"),
        ({"limit": -1}, ValueError, "-1"),
        ({"source": "file"}, ValueError, "path"),
        (
            {"source": "file", "path": "/nonexistent/prompts.jsonl"},
            FileNotFoundError,
            "/nonexistent/prompts.jsonl",
        ),
        ({"source": "file", "path": "/tmp/prompts.txt"}, ValueError, "'.txt'"),
        ({"source": "hf"}, ValueError, "hf_id"),
        ({"path": "/tmp/prompts.jsonl"}, ValueError, "/tmp/prompts.jsonl"),
        ({"hf_id": "org/name"}, ValueError, "'org/name'"),
    ],
)
def test_bad_arguments_are_named(
    kwargs: dict[str, Any], error: type[Exception], named: str
) -> None:
    arguments = {"domain": "math", **kwargs}
    with pytest.raises(error, match=named.replace(".", r"\.").replace("-", r"\-")):
        load_domain(**arguments)


def test_missing_column_names_column_and_available_ones(tmp_path: Path) -> None:
    jsonl = tmp_path / "data.jsonl"
    _write_jsonl(jsonl, [{"question": "q", "answer": "a"}])
    with pytest.raises(ValueError, match=r"'prompt'.*\['question', 'answer'\]"):
        load_domain("math", source="file", path=jsonl)
    with pytest.raises(ValueError, match=r"'solution'.*\['question', 'answer'\]"):
        load_domain(
            "math", source="file", path=jsonl, prompt_column="question", response_column="solution"
        )
    table = tmp_path / "data.csv"
    table.write_text("question,answer\nq,a\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"'text'.*\['question', 'answer'\]"):
        load_domain("math", source="file", path=table, prompt_column="text")


def test_bad_jsonl_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "fine"}\n{not json\n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 2"):
        load_domain("chat", source="file", path=path)


def test_truncated_json_array_stops_at_the_cut() -> None:
    complete = json.dumps([{"id": 1}, {"id": 2}, {"id": 3}], indent=2)
    assert list(_iter_truncated_json_array(complete)) == [{"id": 1}, {"id": 2}, {"id": 3}]
    cut = complete[: complete.index('"id": 3') + 4]
    assert list(_iter_truncated_json_array(cut)) == [{"id": 1}, {"id": 2}]
    assert list(_iter_truncated_json_array("[]")) == []
    with pytest.raises(ValueError, match="malformed"):
        list(_iter_truncated_json_array('[{"id": 1}, {oops}, {"id": 3}]'))


class _WordTokenizer:
    """Just enough of a transformers tokenizer: whitespace words → ids, optional chat template."""

    def __init__(self, chat_template: str | None, returns_mapping: bool = True) -> None:
        self.chat_template = chat_template
        self.returns_mapping = returns_mapping
        self.calls: list[dict[str, Any]] = []

    def _ids(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [0] + self._ids(text)}

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        ids = [1] + self._ids(conversation[0]["content"]) + [2]
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if self.returns_mapping else ids


def test_format_prompt_uses_chat_template_with_generation_prompt() -> None:
    tokenizer = _WordTokenizer("template")
    assert format_prompt(tokenizer, "hi there") == [1, 2, 5, 2]
    assert tokenizer.calls == [{"add_generation_prompt": True, "tokenize": True}]
    assert format_prompt(_WordTokenizer("template", returns_mapping=False), "hi there") == [
        1,
        2,
        5,
        2,
    ]
    assert format_prompt(_WordTokenizer(None), "hi there") == [0, 2, 5]


def test_format_prompt_with_real_transformers_tokenizer() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "user", "assistant", ":", "hello", "world"]
    model = tokenizers.models.WordLevel(
        {word: index for index, word in enumerate(words)}, unk_token="<unk>"
    )
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>"
    )
    assert format_prompt(tokenizer, "hello world") == [5, 6]
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    assert format_prompt(tokenizer, "hello world") == [2, 4, 5, 6, 3, 4]


def test_synthetic_source_splits_like_the_others() -> None:
    from specdecode.data.domains import load_domain

    train = load_domain("math", source="synthetic", split="train")
    heldout = load_domain("math", source="synthetic", split="heldout")
    assert train and heldout and not {e.prompt for e in train} & {e.prompt for e in heldout}
    assert all(e.domain == "math" and e.response for e in train)


def test_file_without_any_prompt_is_named(tmp_path: Path) -> None:
    path = tmp_path / "empty_prompts.jsonl"
    _write_jsonl(path, [{"prompt": "", "response": "a"}, {"prompt": "   ", "response": "b"}])
    with pytest.raises(ValueError, match=r"empty_prompts.jsonl' holds no row with a non-empty 'prompt'"):
        load_domain("code", source="file", path=path, split="all")
