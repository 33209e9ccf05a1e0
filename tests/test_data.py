"""Tests for the domain prompt datasets: embedded sources, the hash split, files, bad inputs."""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path
from typing import Any

import datasets
import pytest

import specdecode.data.domains
from specdecode.data.domains import (
    DOMAINS,
    Example,
    format_prompt,
    heldout_score,
    is_heldout,
    load_domain,
    split_examples,
)
from specdecode.data.embedded import humaneval, iter_truncated_json_array


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
    assert code[0].prompt.startswith("from typing import List\n\n\ndef has_close_elements(")  # HumanEval/0
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
    return [Example(prompt=f"prompt number {index}", response=f"r{index}", domain=domain) for index in range(count)]


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
    assert heldout_score("What is the capital of France?") == pytest.approx(0.06763134212117156, abs=0)
    assert heldout_score("\ud83d lone surrogate") >= 0.0  # scraped text must not crash the hash


def test_later_turns_follow_their_opening_and_are_never_held_out() -> None:
    openings = _examples(400)
    later = [
        Example(f"a later turn {i}", None, "chat", conversation=opening.prompt) for i, opening in enumerate(openings)
    ]
    train = split_examples(openings + later, "train", 0.3)
    trained_openings = {e.prompt for e in train if e.conversation is None}
    kept_later = [e for e in train if e.conversation is not None]
    # Exactly the later turns whose conversation opens with a training prompt, whatever their own
    # text hashes to.
    assert {e.conversation for e in kept_later} == trained_openings
    assert any(is_heldout(e.prompt, 0.3) for e in kept_later)
    assert split_examples(openings + later, "heldout", 0.3) == split_examples(openings, "heldout", 0.3)
    assert split_examples(openings + later, "all", 0.3) == split_examples(openings, "all", 0.3) + kept_later


def test_embedded_chat_later_turns_only_add_training_prompts() -> None:
    opening = load_domain("chat")
    everything = load_domain("chat", chat_turns="all")
    heldout = {e.prompt for e in load_domain("chat", split="heldout")}
    assert everything[: len(opening)] == opening  # a prefix: the first N sequences stay the same
    later = everything[len(opening) :]
    assert len(later) > 2 * len(opening)
    assert all(e.conversation not in heldout and e.prompt not in heldout for e in later)
    assert all(20 <= len(e.prompt.strip()) and len(e.prompt) <= 4000 for e in later)
    assert load_domain("chat", split="heldout", chat_turns="all") == load_domain("chat", split="heldout")
    assert load_domain("math", chat_turns="all") == load_domain("math")
    with pytest.raises(ValueError, match="'later'"):
        load_domain("chat", chat_turns="later")


def test_first_duplicate_wins() -> None:
    first = Example("same", "one", "chat")
    second = Example("same", "two", "chat")
    assert split_examples([first, second], "all") == [first]


def test_hf_source_uses_load_dataset_with_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []

    def load_dataset(
        hf_id: str, name: str | None = None, *, split: str, revision: str | None = None
    ) -> datasets.Dataset:
        calls.append((hf_id, name, split, revision))
        return datasets.Dataset.from_list([{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    examples = load_domain(
        "math",
        source="hf",
        hf_id="org/gsm",
        hf_split="test",
        hf_name="main",
        revision="v1.0",
        split="all",
        prompt_column="question",
        response_column="answer",
    )
    assert calls == [("org/gsm", "main", "test", "v1.0")]
    assert examples == [Example("1+1?", "2", "math"), Example("2+2?", "4", "math")]
    with pytest.raises(ValueError, match=r"'prompt'.*\['question', 'answer'\]"):
        load_domain("math", source="hf", hf_id="org/gsm", split="all")


def test_hf_source_that_cannot_load_names_the_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    def load_dataset(hf_id: str, name: str | None = None, **kwargs: Any) -> datasets.Dataset:
        raise ConnectionError("Couldn't reach the Hub")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    named = r"'org/gsm' \(split 'test'\).*Couldn't reach the Hub.*source=file"
    with pytest.raises(OSError, match=named) as raised:
        load_domain("math", source="hf", hf_id="org/gsm", hf_split="test")
    assert isinstance(raised.value.__cause__, ConnectionError)


def test_embedded_default_goes_through_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    # GSM8K's JSON-lines file is parsed by load_dataset; every source is mapped from a Dataset.
    builders: list[tuple[str, str]] = []
    mapped: list[datasets.Dataset] = []
    real_load, real_to_examples = datasets.load_dataset, specdecode.data.domains._to_examples

    def load_dataset(builder: str, *args: Any, **kwargs: Any) -> Any:
        builders.append((builder, Path(kwargs["data_files"]).name))
        return real_load(builder, *args, **kwargs)

    def to_examples(dataset: datasets.Dataset, *args: Any) -> list[Example]:
        mapped.append(dataset)
        return real_to_examples(dataset, *args)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(specdecode.data.domains, "_to_examples", to_examples)
    specdecode.data.domains._embedded.cache_clear()
    try:
        math = load_domain("math", split="all")
    finally:
        # Later tests should not reuse a parse made through the spies.
        specdecode.data.domains._embedded.cache_clear()
    assert builders == [("json", "test.jsonl")]
    (dataset,) = mapped
    assert isinstance(dataset, datasets.Dataset) and dataset.column_names == ["prompt", "response"]
    assert len(dataset) == len(math) == 1319
    assert load_domain("math", source="synthetic", split="all")
    assert isinstance(mapped[-1], datasets.Dataset)


def test_humaneval_is_read_by_load_dataset_from_its_gzipped_file() -> None:
    dataset = humaneval()
    assert dataset.column_names == ["prompt", "response"] and len(dataset) == 164
    assert dataset[0]["prompt"].startswith("from typing import List")
    assert "return False" in dataset[0]["response"]


def test_data_and_smoke_do_not_import_each_other() -> None:
    # The data layer sits below the smoke stand-ins: the synthetic examples live in the data layer,
    # and the smoke model and tokenizer need nothing of it. Read statically, so the test is instant.
    root = Path(specdecode.data.domains.__file__).parents[1]

    def imported(module: str) -> set[str]:
        tree = ast.parse((root / f"{module}.py").read_text(encoding="utf-8"))
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        return {name for name in names if name.startswith("specdecode")}

    assert not {m for m in imported("models/smoke") if m.startswith("specdecode.data")}
    for module in ("data/domains", "data/files", "data/embedded"):
        assert "specdecode.models.smoke" not in imported(module)
    assert imported("data/files") == set()
    assert imported("data/embedded") == {"specdecode.data.files"}


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
def test_bad_arguments_are_named(kwargs: dict[str, Any], error: type[Exception], named: str) -> None:
    arguments = {"domain": "math", **kwargs}
    with pytest.raises(error, match=named.replace(".", r"\.").replace("-", r"\-")):
        load_domain(**arguments)


def test_truncated_json_array_stops_at_the_cut() -> None:
    complete = json.dumps([{"id": 1}, {"id": 2}, {"id": 3}], indent=2)
    assert list(iter_truncated_json_array(complete)) == [{"id": 1}, {"id": 2}, {"id": 3}]
    cut = complete[: complete.index('"id": 3') + 4]
    assert list(iter_truncated_json_array(cut)) == [{"id": 1}, {"id": 2}]
    assert list(iter_truncated_json_array("[]")) == []
    with pytest.raises(ValueError, match="malformed"):
        list(iter_truncated_json_array('[{"id": 1}, {oops}, {"id": 3}]'))


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
    model = tokenizers.models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="<unk>")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>")
    assert format_prompt(tokenizer, "hello world") == [5, 6]
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    assert format_prompt(tokenizer, "hello world") == [2, 4, 5, 6, 3, 4]


def test_synthetic_source_splits_like_the_others() -> None:
    from specdecode.data import load_domain

    train = load_domain("math", source="synthetic", split="train")
    heldout = load_domain("math", source="synthetic", split="heldout")
    assert train and heldout and not {e.prompt for e in train} & {e.prompt for e in heldout}
    assert all(e.domain == "math" and e.response for e in train)
