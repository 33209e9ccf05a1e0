"""The record every data source gives: a prompt, its reference response if any, its domain."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """One prompt, the reference response if the source has one, and its domain.

    Frozen because the embedded datasets are cached and shared between callers. `conversation`, set
    on a later turn of a conversation (ShareGPT's, `chat_turns="all"`), is the conversation's opening
    prompt: the turn is a training prompt only, and only where its conversation's opening is one
    (`specdecode.data.domains.split_examples`), so no held-out conversation leaks into training.
    """

    prompt: str
    response: str | None
    domain: str
    conversation: str | None = None
    # A chat prompt as (role, content) turns ending at its last user turn: rendered with the target's
    # chat template by `format_prompt`; `prompt` is then its text (hashed for the split, routed on).
    messages: tuple[tuple[str, str], ...] | None = None

    def chat(self) -> list[dict[str, str]]:
        """The prompt as chat messages: its own turns, or one user turn of `prompt`."""
        if self.messages is None:
            return [{"role": "user", "content": self.prompt}]
        return [{"role": role, "content": content} for role, content in self.messages]
