"""The record every data source gives: a prompt, its reference response if any, its domain (and
its kind, in a domain of several kinds)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """One prompt, the reference response if the source has one, and its domain; frozen, since the
    embedded datasets are cached and shared. `conversation`, on a later turn, is the opening prompt
    that decides the turn's split, so no held-out conversation leaks into training."""

    prompt: str
    response: str | None
    domain: str
    conversation: str | None = None
    # A chat prompt as (role, content) turns ending at its last user turn; `prompt` is then its text.
    messages: tuple[tuple[str, str], ...] | None = None
    # What the prompt asks within its domain (the mixed domain's `gsm8k`, `gpqa`, ...); None in a domain of one kind.
    kind: str | None = None

    def chat(self) -> list[dict[str, str]]:
        """The prompt as chat messages: its own turns, or one user turn of `prompt`."""
        if self.messages is None:
            return [{"role": "user", "content": self.prompt}]
        return [{"role": role, "content": content} for role, content in self.messages]
