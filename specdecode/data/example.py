"""The record every data source gives: a prompt, its reference response if any, its domain (and
its kind, in a domain of several kinds)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """One prompt, the reference response if the source has one, and its domain.

    Frozen because the embedded datasets are cached and shared between callers. `conversation`, set
    on a later turn of a conversation, is the conversation's opening prompt, which decides the
    turn's split (`specdecode.data.domains.split_examples`), so no held-out conversation leaks into
    training. A later turn alone (ShareGPT's, `chat_turns="all"`) is a training prompt only, where
    its opening is one; a later turn with its conversation's earlier turns (`messages`, the mixed
    domain's) is held out where its opening is and trained on where it is.
    """

    prompt: str
    response: str | None
    domain: str
    conversation: str | None = None
    # A chat prompt as (role, content) turns ending at its last user turn: rendered with the target's
    # chat template by `format_prompt`; `prompt` is then its text (hashed for the split, routed on).
    messages: tuple[tuple[str, str], ...] | None = None
    # What the prompt asks within its domain (the mixed domain's `gsm8k`, `gpqa`, ...); None in a domain of one kind.
    kind: str | None = None

    def chat(self) -> list[dict[str, str]]:
        """The prompt as chat messages: its own turns, or one user turn of `prompt`."""
        if self.messages is None:
            return [{"role": "user", "content": self.prompt}]
        return [{"role": role, "content": content} for role, content in self.messages]
