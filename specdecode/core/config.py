"""Config helpers every stage's schema uses: `from_dict`, `require`, the app-wide `Placement`, the
gamma bound. Each stage's structured configs (the schema behind conf/*.yaml) live with the stage
(`specdecode.<stage>.config`); each validates itself and names the bad field."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from specdecode.core.devices import check_device_name, check_dtype_name

T = TypeVar("T")

# Largest gamma (drafted tokens per target pass) any entry point accepts. Acceptance decays
# geometrically along a draft, so past a few dozen tokens more drafting only burns drafter calls
# and KV-cache slots (each row reserves gamma + 1 slack slots); a typo like gamma=100000 would
# draft that many tokens per step whatever the token budget.
MAX_GAMMA = 64


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from a (Hydra-resolved) dict; unknown keys are an error, not ignored."""
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown config field(s) {', '.join(where + k for k in unknown)}; known: {sorted(known)}")
    # Nested configs are whatever fields are annotated with a dataclass type.
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        nested = hints.get(name)
        if dataclasses.is_dataclass(nested) and isinstance(value, dict):
            value = from_dict(nested, value, f"{where}{name}.")  # type: ignore[arg-type]
        kwargs[name] = value
    return cls(**kwargs)


def require(condition: bool, name: str, value: object, expectation: str) -> None:
    """Raise `ValueError("name=value: expectation")` unless `condition` holds."""
    if not condition:
        raise ValueError(f"{name}={value!r}: {expectation}")


def is_int(value: object) -> bool:
    """An int that is not a bool (YAML's `true` must not pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class Placement:
    """The one `device` / `dtype` of an app (top level of its conf/*.yaml): the target, the drafters,
    the embedder and accelerate all follow it; `skinny_matmul` picks the CPU kernel of the models'
    linear layers. Apps subclass this and call `check_placement()`."""

    device: str = "cpu"
    dtype: str = "float32"
    # On CPU, linear layers over 2..64 rows run as `weight @ x.T` (specdecode.models.cpu_matmul),
    # which makes a verify pass cost about one decode step; false keeps plain `F.linear`.
    skinny_matmul: bool = True

    def check_placement(self) -> None:
        self.device = check_device_name(self.device)
        self.dtype = check_dtype_name(self.dtype)
        require(isinstance(self.skinny_matmul, bool), "skinny_matmul", self.skinny_matmul, "true or false")
