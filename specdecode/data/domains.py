"""Prompt datasets of drafter domains: code, math, chat, the mixed traffic and any a user defines
(`conf/data/<name>.yaml`), from four sources: "embedded" (pip packages), "hf", "file" and
"synthetic". Train / held-out membership is a hash of the prompt text, so a held-out prompt stays
held out in every job, whichever source or subset it comes through.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import datasets

from specdecode.core.config import is_number, require, require_choice, require_int
from specdecode.data.embedded import embedded_dataset, sharegpt_later_turns, synthetic_dataset
from specdecode.data.example import Example
from specdecode.data.files import read_data_file
from specdecode.data.messages import is_messages, messages_text, parse_messages
from specdecode.data.mixed import MIXED, mixed_examples

# The built-in domains, whose data is embedded; any other name is a domain a data config defines.
DOMAINS = ("code", "math", "chat")
# The domains with embedded data: the built-in ones, and the mixed traffic they are evaluated on too.
EMBEDDED = (*DOMAINS, MIXED)
# A domain name names folders, drafters (`specialized:<name>`) and config files.
DOMAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
DOMAIN_NAME_RULE = "a domain name: letters, digits, '_', '.' or '-', starting with a letter or digit"
SOURCES = ("embedded", "hf", "file", "synthetic")
SPLITS = ("train", "heldout", "all")
CHAT_TURNS = ("opening", "all")

Split = Literal["train", "heldout", "all"]


def heldout_score(prompt: str) -> float:
    """A prompt's number in [0, 1), uniform over prompts and stable across machines (SHA-256; a lone
    surrogate, as scraped JSON holds, hashes instead of raising)."""
    digest = hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_heldout(prompt: str, heldout_fraction: float = 0.1) -> bool:
    """Whether `prompt` is held out: `heldout_score(prompt) < heldout_fraction`."""
    check_heldout_fraction(heldout_fraction)
    return heldout_score(prompt) < heldout_fraction


def split_examples(examples: Iterable[Example], split: Split = "all", heldout_fraction: float = 0.1) -> list[Example]:
    """Deduplicate by prompt and keep the examples of one split, in input order. A later turn goes
    where its conversation's opening goes; one alone (no earlier turns in `messages`) is never held out."""
    require_choice("split", split, SPLITS)
    check_heldout_fraction(heldout_fraction)
    seen: set[str] = set()
    kept: list[Example] = []
    for example in examples:
        if example.prompt in seen:
            continue
        seen.add(example.prompt)
        in_heldout = heldout_score(example.conversation or example.prompt) < heldout_fraction
        alone = example.conversation is not None and example.messages is None
        if alone and (in_heldout or split == "heldout"):
            continue
        if split == "all" or in_heldout == (split == "heldout"):
            kept.append(example)
    return kept


def load_domain(
    domain: str,
    *,
    source: str = "embedded",
    split: Split = "train",
    limit: int | None = None,
    heldout_fraction: float = 0.1,
    path: str | Path | None = None,
    hf_id: str | None = None,
    hf_split: str = "train",
    hf_name: str | None = None,
    revision: str | None = None,
    prompt_column: str = "prompt",
    response_column: str | None = None,
    chat_turns: str = "opening",
) -> list[Example]:
    """Load one domain's prompts from a source (the fields of `DataConfig`), deduplicated, split, in
    a deterministic order, at most `limit`, kinds taking turns. `prompt_column` holds text or chat
    `messages`; `chat_turns="all"` adds the embedded chat's later user turns to its training split.
    A ValueError names a bad argument, column or file; OSError: an "hf" source that did not load.
    """
    _check_arguments(domain, source, split, limit, heldout_fraction, path, hf_id)
    require_choice("chat_turns", chat_turns, CHAT_TURNS)
    examples: Iterable[Example]
    if source == "embedded":
        examples = _embedded(domain)
        if chat_turns == "all" and domain == "chat":
            examples = (*examples, *_embedded_later_turns())
    elif source == "synthetic":
        examples = _to_examples(synthetic_dataset(domain), domain, "prompt", "response", "synthetic data")
    elif source == "hf":
        examples = _from_hf(domain, hf_id, hf_split, hf_name, revision, prompt_column, response_column)  # type: ignore[arg-type]  # _check_arguments requires hf_id for hf
    else:
        where = f"domain {domain!r}, file {str(path)!r}"
        examples = _to_examples(read_data_file(Path(path)), domain, prompt_column, response_column, where)  # type: ignore[arg-type]  # _check_arguments requires path for file
        if not examples:
            raise ValueError(f"{where} holds no row with a non-empty {prompt_column!r}")
    kept = by_kind_in_turns(split_examples(examples, split, heldout_fraction))
    return kept if limit is None else kept[:limit]


def by_kind_in_turns(examples: list[Example]) -> list[Example]:
    """`examples` round by round, each round one of each kind still left, kinds in order of appearance."""
    kinds: dict[str | None, list[Example]] = {}
    for example in examples:
        kinds.setdefault(example.kind, []).append(example)
    if len(kinds) < 2:
        return examples
    rounds = max(len(members) for members in kinds.values())
    return [members[i] for i in range(rounds) for members in kinds.values() if i < len(members)]


def _check_arguments(
    domain: str,
    source: str,
    split: str,
    limit: int | None,
    heldout_fraction: float,
    path: str | Path | None,
    hf_id: str | None,
) -> None:
    """`load_domain`'s checks, before any data is read."""
    check_domain_name("domain", domain)
    require_choice("source", source, SOURCES)
    if source == "embedded" and domain not in EMBEDDED:
        raise ValueError(
            f"domain {domain!r} has no embedded data (embedded: {', '.join(EMBEDDED)}); "
            "give it source file (path) or hf (hf_id) in its data config"
        )
    require_choice("split", split, SPLITS)
    check_heldout_fraction(heldout_fraction)
    require_int("limit", limit, 0, nullable=True)
    # A path or hub id given to the wrong source is a config mistake, not to be trained past.
    require(path is None or source == "file", "path", path, f"only read with source='file', got {source=}")
    require(hf_id is None or source == "hf", "hf_id", hf_id, f"only read with source='hf', got {source=}")
    require(source != "hf" or bool(hf_id), "hf_id", hf_id, "source='hf' needs a dataset id")
    files = "a .jsonl, .jsonl.gz, .json, .csv or .parquet file"
    require(source != "file" or path is not None, "path", path, f"domain {domain!r}: source='file' needs {files}")


def format_prompt(tokenizer: Any, prompt: str | Example) -> list[int]:
    """`[T]` token ids of a prompt (text, or an `Example` with its chat turns) in the target's chat
    template with the generation prompt; without a template, the text's plain tokenisation."""
    example = prompt if isinstance(prompt, Example) else Example(prompt=prompt, response=None, domain="")
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer(example.prompt)["input_ids"])
    encoded = tokenizer.apply_chat_template(example.chat(), add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding (a Mapping); older versions return the ids directly.
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        (ids,) = ids
    return [int(token) for token in ids]


def prompts_within(tokenizer: Any, examples: Iterable[Example], max_tokens: int) -> Iterator[tuple[Example, list[int]]]:
    """Each example with its `format_prompt` ids, lazily, those over `max_tokens` skipped (never cut)."""
    for example in examples:
        ids = format_prompt(tokenizer, example)
        if 0 < len(ids) <= max_tokens:
            yield example, ids


def check_heldout_fraction(value: float, key: str = "heldout_fraction") -> None:
    """`value` is a number in (0, 1); else a ValueError naming `key`."""
    require(is_number(value) and 0 < value < 1, key, value, "in (0, 1)")


def check_domain_name(key: str, name: object) -> None:
    """`name` is a domain name (`DOMAIN_NAME`); else a ValueError naming `key`."""
    require(isinstance(name, str) and bool(DOMAIN_NAME.fullmatch(name)), key, name, DOMAIN_NAME_RULE)


def check_domains(domains: object, key: str = "domains") -> list[str]:
    """`domains` if it is a non-empty list of distinct domain names; otherwise a ValueError naming it."""
    require(
        isinstance(domains, (list, tuple))
        and bool(domains)
        and len(set(domains)) == len(domains)
        and all(isinstance(d, str) and DOMAIN_NAME.fullmatch(d) for d in domains),
        key,
        domains,
        "a non-empty list of distinct domain names (each defined by conf/data/<name>.yaml)",
    )
    return [str(d) for d in domains]  # type: ignore[attr-defined]  # `require` above checked it is a list


def _text(value: Any) -> str | None:
    """A cell as text; None, NaN and "" count as missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    text = value if isinstance(value, str) else str(value)
    return text if text else None


def _to_examples(
    dataset: datasets.Dataset, domain: str, prompt_column: str, response_column: str | None, where: str
) -> list[Example]:
    """A dataset's rows as Examples, in order, skipping empty prompts; `where` names the source in errors.
    A list cell is a chat `messages` conversation, whose trailing assistant reply is the response
    where no response column is named; any other cell that is not text or a number is an error."""
    wanted = [prompt_column] + ([response_column] if response_column is not None else [])
    available = list(dataset.column_names)
    for column in wanted:
        if column not in available:
            raise ValueError(f"column {column!r} not found in {where}; available columns: {available}")
    # Whole columns at once: indexing a dataset row by row costs a formatting step per row.
    columns = dataset.select_columns(list(dict.fromkeys(wanted))).to_dict()
    responses = columns[response_column] if response_column is not None else [None] * len(dataset)
    examples = []
    for row, (prompt_cell, response_cell) in enumerate(zip(columns[prompt_column], responses, strict=True)):
        if is_messages(prompt_cell):
            turns, reply = parse_messages(prompt_cell, f"{where}, column {prompt_column!r}, row {row}")
            response = _text(response_cell) if response_column is not None else reply
            examples.append(Example(prompt=messages_text(turns), response=response, domain=domain, messages=turns))
            continue
        if prompt_cell is not None and not isinstance(prompt_cell, (str, int, float)):
            raise ValueError(
                f"{where}, column {prompt_column!r}, row {row}: a prompt must be text or a "
                f"messages list, got {type(prompt_cell).__name__} {str(prompt_cell)[:60]!r}"
            )
        prompt = _text(prompt_cell)
        if prompt is None or not prompt.strip():
            continue
        examples.append(Example(prompt=prompt, response=_text(response_cell), domain=domain))
    return examples


def _from_hf(
    domain: str,
    hf_id: str,
    hf_split: str,
    hf_name: str | None,
    revision: str | None,
    prompt_column: str,
    response_column: str | None,
) -> list[Example]:
    """Read a split of a hub dataset (or of anything else `datasets.load_dataset` takes by name)."""
    where = f"domain {domain!r}, hf dataset {hf_id!r} (split {hf_split!r})"
    try:
        dataset = datasets.load_dataset(hf_id, hf_name, split=hf_split, revision=revision)
    except Exception as error:
        # datasets' errors differ by cause and some do not name the dataset; this one does.
        raise OSError(
            f"could not load {where}: {type(error).__name__}: {error}. Without a hub connection, "
            "use data.source=file with a local .jsonl, .csv or .parquet copy"
        ) from error
    return _to_examples(dataset, domain, prompt_column, response_column, where)


@functools.cache
def _embedded(domain: str) -> tuple[Example, ...]:
    """The offline default dataset of a domain, deduplicated, parsed once per process."""
    if domain == MIXED:
        return tuple(split_examples(mixed_examples(), "all"))
    examples = _to_examples(embedded_dataset(domain), domain, "prompt", "response", f"embedded {domain} data")
    return tuple(split_examples(examples, "all"))


@functools.cache
def _embedded_later_turns() -> tuple[Example, ...]:
    """The embedded chat conversations' later user turns (`sharegpt_later_turns`), parsed once."""
    rows = sharegpt_later_turns().to_dict()
    return tuple(
        Example(prompt=prompt, response=response, domain="chat", conversation=conversation)
        for prompt, response, conversation in zip(rows["prompt"], rows["response"], rows["conversation"], strict=True)
    )
