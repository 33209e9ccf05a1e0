"""The record every data source gives: a prompt, its reference response if any, its domain."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """One prompt, the reference response if the source has one, and its domain.

    Frozen because the embedded datasets are cached and shared between callers.
    """

    prompt: str
    response: str | None
    domain: str
