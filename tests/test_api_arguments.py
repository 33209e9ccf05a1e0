"""Every argument of the public decode API: a value of the wrong type or range fails with a
TypeError or ValueError that names the argument, before any decoding (no torch error from deep
inside the loop)."""

from __future__ import annotations

from typing import Any

import pytest

from specdecode import autoregressive_generate, speculative_generate

# (argument, a bad value): each must be refused naming the argument
SHARED_BAD: list[tuple[str, Any]] = [
    ("prompts", "a b c"),
    ("prompts", [[1, 2.5]]),
    ("max_new_tokens", "8"),
    ("max_new_tokens", -1),
    ("temperature", "hot"),
    ("temperature", -0.5),
    ("top_k", 1.5),
    ("top_k", -1),
    ("top_p", "all"),
    ("top_p", 1.5),
    ("eos_token_ids", 2.0),
    ("eos_token_ids", "eos"),
    ("seed", "x"),
    ("seed", 1.5),
    ("seed", True),
    ("static", "yes"),
    ("compile", "yes"),
    ("capacity", "big"),
    ("record", "yes"),
    ("on_step", 3),
]
SPECULATIVE_BAD: list[tuple[str, Any]] = [("gamma", 0), ("gamma", "4"), ("gamma", 2.0), ("prompt_lookup", "on")]
AUTOREGRESSIVE_BAD: list[tuple[str, Any]] = [("feature_layers", "last"), ("feature_layers", [1.5])]


def _calls(make_tiny_llama) -> dict[str, Any]:
    target = make_tiny_llama(seed=0)
    drafter = make_tiny_llama(seed=1, num_hidden_layers=1)
    return {
        "speculative_generate": lambda **kw: speculative_generate(target, drafter, **kw),
        "autoregressive_generate": lambda **kw: autoregressive_generate(target, **kw),
    }


@pytest.mark.parametrize(
    "entry, name, value",
    [("speculative_generate", n, v) for n, v in SHARED_BAD + SPECULATIVE_BAD]
    + [("autoregressive_generate", n, v) for n, v in SHARED_BAD + AUTOREGRESSIVE_BAD],
)
def test_a_bad_argument_is_named(make_tiny_llama, entry: str, name: str, value: Any) -> None:
    call = _calls(make_tiny_llama)[entry]
    arguments: dict[str, Any] = {"prompts": [[5, 6, 7]], "max_new_tokens": 4} | {name: value}
    with pytest.raises((TypeError, ValueError), match=name.removesuffix("s")):
        call(**arguments)


@pytest.mark.parametrize("seed", [0, 7, 2**40])
def test_integer_seeds_are_accepted(make_tiny_llama, seed: int) -> None:
    call = _calls(make_tiny_llama)["speculative_generate"]
    result = call(prompts=[[5, 6, 7]], max_new_tokens=3, temperature=1.0, seed=seed)
    assert len(result.sequences[0]) == 3
