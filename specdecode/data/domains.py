"""Prompt datasets of drafter domains: the three built in (code, math, chat), the mixed traffic
(`mixed`), and any a user defines.

A domain is a name and its data (a `DataConfig`, `conf/data/<name>.yaml`). A drafter is trained on
one domain's prompts (the target writes the responses, or the dataset's own responses are used)
and evaluated on that domain's held-out prompts. Four sources give the same
`Example` records, each first read into a `datasets.Dataset` and mapped to examples one way:

- "embedded": offline defaults read from pip packages, so nothing needs a hub
  (`specdecode.data.embedded`: HumanEval + stdlib functions, GSM8K test, ShareGPT openings; and the
  mixed domain's seven kinds of prompts, `specdecode.data.mixed`);
- "hf": `datasets.load_dataset(hf_id, hf_name, split=hf_split, revision=revision)` with a column mapping;
- "file": a local .jsonl, .jsonl.gz, .json, .csv or .parquet file with a column mapping, read by
  `datasets.load_dataset` (`specdecode.data.files`);
- "synthetic": tiny templated examples for smoke runs.

Train / held-out membership is a pure function of the prompt text (a SHA-256 hash), never of a
seed or of the order rows arrive in, so a held-out prompt stays held out in every job that reads
it, whichever source or subset it comes through.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import datasets

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
SOURCES = ("embedded", "hf", "file", "synthetic")
SPLITS = ("train", "heldout", "all")
CHAT_TURNS = ("opening", "all")

Split = Literal["train", "heldout", "all"]


def heldout_score(prompt: str) -> float:
    """Map a prompt to a number in [0, 1), uniform over prompts and stable across runs and machines.

    The first 8 bytes of SHA-256 of the UTF-8 text; `surrogatepass` so a lone surrogate (which
    scraped JSON such as ShareGPT contains) hashes instead of raising.
    """
    digest = hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_heldout(prompt: str, heldout_fraction: float = 0.1) -> bool:
    """Whether `prompt` is held out: `heldout_score(prompt) < heldout_fraction`."""
    _check_fraction(heldout_fraction)
    return heldout_score(prompt) < heldout_fraction


def split_examples(examples: Iterable[Example], split: Split = "all", heldout_fraction: float = 0.1) -> list[Example]:
    """Deduplicate by prompt (first occurrence wins) and keep the examples of one split.

    Order is the input order, so a deterministic source gives a deterministic result; membership
    depends on the prompt alone, so reordering the input only reorders the output. A later turn of a
    conversation (`Example.conversation` set) goes where its conversation's opening prompt goes, so
    none of a held-out conversation is trained on; a later turn alone (no earlier turns in
    `messages`) is never held out, so that the held-out split of a chat domain stays opening prompts:
    it is dropped where its opening is held out.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    _check_fraction(heldout_fraction)
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
    """Load one domain's prompts from a source, deduplicated, split, in a deterministic order.

    Args:
        domain: the domain's name, labelling every example; with source "embedded", one of `EMBEDDED`.
        source: "embedded" (offline defaults), "hf" (a hub dataset), "file" (a local file) or
            "synthetic" (tiny templated examples for smoke runs).
        split: "train", "heldout" or "all" (both, deduplicated).
        limit: keep at most this many examples, the first ones after splitting; None keeps all.
        heldout_fraction: share of prompts held out, in (0, 1).
        path: the local file, for source "file" (.jsonl, .jsonl.gz, .json, .csv or .parquet).
        hf_id: the dataset id for `datasets.load_dataset`, for source "hf".
        hf_split: the split of the hub dataset to read (its own split, before ours).
        hf_name: the hub dataset's configuration (subset) name, if it has several.
        revision: the hub dataset's revision (branch, tag or commit).
        prompt_column: column (or JSON key) holding the prompt, for "hf" and "file": text, or a chat
            `messages` list of {role, content} turns (`specdecode.data.messages`).
        response_column: column holding the reference response, or None for prompts only.
        chat_turns: "opening" or "all": with "all", the embedded chat data's training split goes on,
            after its opening prompts, with the later user turns of their conversations
            (`specdecode.data.embedded.sharegpt_later_turns`), about three times as many prompts.
            The held-out split is the same either way; other domains and sources have no later turns.

    Returns the examples; rows with an empty or missing prompt are skipped. Examples of several kinds
    (the mixed domain's) take turns by kind (`by_kind_in_turns`), so that any first few hold every kind.

    Raises ValueError: an unknown domain, source or split, a bad limit or fraction, a missing column, or
    a source argument that is missing or given to the wrong source; a data file that cannot be parsed
    (naming the file, and for JSON lines the line); FileNotFoundError: `path` does not exist; OSError:
    `datasets.load_dataset` failed for an "hf" source (no hub, unknown id, ...).
    """
    _check_arguments(domain, source, split, limit, heldout_fraction, path, hf_id)
    if chat_turns not in CHAT_TURNS:
        raise ValueError(f"unknown chat_turns {chat_turns!r}; valid: {', '.join(CHAT_TURNS)}")
    examples = _source_examples(
        domain, source, path, hf_id, hf_split, hf_name, revision, prompt_column, response_column
    )
    if chat_turns == "all" and source == "embedded" and domain == "chat":
        examples = (*examples, *_embedded_later_turns())
    kept = by_kind_in_turns(split_examples(examples, split, heldout_fraction))
    return kept if limit is None else kept[:limit]


def by_kind_in_turns(examples: list[Example]) -> list[Example]:
    """`examples` round by round, each round one of each kind still left (kinds in the order they
    first appear, each kind's examples in their own order); examples of one kind stay as they are."""
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
    """`load_domain`'s checks, before any data is read (see its Raises)."""
    if not isinstance(domain, str) or not DOMAIN_NAME.fullmatch(domain):
        raise ValueError(
            f"domain name {domain!r} must be letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r} of domain {domain!r}; valid sources: {', '.join(SOURCES)}")
    if source == "embedded" and domain not in EMBEDDED:
        raise ValueError(
            f"domain {domain!r} has no embedded data (embedded: {', '.join(EMBEDDED)}); "
            "give it source file (path) or hf (hf_id) in its data config"
        )
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    _check_fraction(heldout_fraction)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
    # A path or hub id passed to the wrong source is almost always a config mistake; silently
    # training on the embedded defaults instead would be worse than stopping.
    if path is not None and source != "file":
        raise ValueError(f"path={str(path)!r} is only read with source='file', got source={source!r}")
    if hf_id is not None and source != "hf":
        raise ValueError(f"hf_id={hf_id!r} is only read with source='hf', got source={source!r}")
    if source == "hf" and not hf_id:
        raise ValueError(f"source='hf' needs hf_id (a dataset id), got {hf_id!r}")
    if source == "file" and path is None:
        raise ValueError(
            f"domain {domain!r}: source='file' needs path (a .jsonl, .jsonl.gz, .json, .csv or .parquet file), got None"
        )


def _source_examples(
    domain: str,
    source: str,
    path: str | Path | None,
    hf_id: str | None,
    hf_split: str,
    hf_name: str | None,
    revision: str | None,
    prompt_column: str,
    response_column: str | None,
) -> Iterable[Example]:
    """Every example of `domain` in `source`, before the split (arguments already checked)."""
    if source == "embedded":
        return _embedded(domain)
    if source == "synthetic":
        return _to_examples(synthetic_dataset(domain), domain, "prompt", "response", "synthetic data")
    if source == "hf":
        return _from_hf(domain, hf_id, hf_split, hf_name, revision, prompt_column, response_column)  # type: ignore[arg-type]  # DataConfig requires hf_id and hf_split for hf
    where = f"domain {domain!r}, file {str(path)!r}"
    examples = _to_examples(read_data_file(Path(path)), domain, prompt_column, response_column, where)  # type: ignore[arg-type]  # DataConfig requires path for file
    if not examples:
        raise ValueError(f"{where} holds no row with a non-empty {prompt_column!r}")
    return examples


def format_prompt(tokenizer: Any, prompt: str | Example) -> list[int]:
    """`[T]` token ids of a prompt (the user's message, or an `Example`, whose own chat turns are
    rendered) in the target's chat template, followed by the assistant's generation prompt. A
    tokenizer without a chat template (a base model) gives the text's plain tokenisation."""
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


def _check_fraction(heldout_fraction: float) -> None:
    valid = (
        isinstance(heldout_fraction, (int, float))
        and not isinstance(heldout_fraction, bool)
        and 0.0 < heldout_fraction < 1.0
    )
    if not valid:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction!r}")


def _text(value: Any) -> str | None:
    """A cell as text; None, NaN (a float column's missing value) and "" (an empty csv cell) count
    as missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    text = value if isinstance(value, str) else str(value)
    return text if text else None


def _to_examples(
    dataset: datasets.Dataset,
    domain: str,
    prompt_column: str,
    response_column: str | None,
    where: str,
) -> list[Example]:
    """Map a dataset's rows to Examples, in order; rows with an empty or missing prompt are skipped.
    `where` names the source in the error naming a missing column and the available ones.

    A prompt cell that is a list is a chat `messages` conversation (`parse_messages`); its trailing
    assistant reply is the response when no response column is named. Any other cell that is not
    text or a number is an error naming the row, never trained on as its repr.
    """
    wanted = [prompt_column] + ([response_column] if response_column is not None else [])
    available = list(dataset.column_names)
    for column in wanted:
        if column not in available:
            raise ValueError(f"column {column!r} not found in {where}; available columns: {available}")
    # Whole columns at once: Arrow converts a column to Python in one call, where indexing a
    # dataset row by row costs a formatting step per row.
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
        # datasets' errors differ by cause (no network, unknown id, gated repo, unknown split) and
        # some do not say which dataset was asked for; this one does, and keeps the cause chained.
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
