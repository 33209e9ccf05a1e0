"""Chat `messages` cells (lists of {role, content} turns) as prompts: the conversation up to its
last user turn. A one-turn conversation's text is its content, the same prompt as the plain text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


def is_messages(cell: Any) -> bool:
    """Whether a cell is meant as chat turns (a list, as JSON and Arrow give them), not text."""
    return isinstance(cell, Sequence) and not isinstance(cell, (str, bytes))


def parse_messages(cell: Any, where: str) -> tuple[tuple[tuple[str, str], ...], str | None]:
    """`(turns, reply)` of a `messages` cell: the (role, content) turns up to the last user turn, and
    the assistant turn right after it (or None). A ValueError names `where` for a malformed cell."""
    if not is_messages(cell) or not cell:
        raise ValueError(
            f"{where}: a messages cell must be a non-empty list of {{role, content}} turns, got {_short(cell)}"
        )
    turns: list[tuple[str, str]] = []
    for i, turn in enumerate(cell):
        if (
            not isinstance(turn, Mapping)
            or not isinstance(turn.get("role"), str)
            or not isinstance(turn.get("content"), str)
        ):
            raise ValueError(f"{where}: turn {i} must be a {{role, content}} mapping of strings, got {_short(turn)}")
        if turn["role"] not in ROLES:
            raise ValueError(f"{where}: turn {i} has role {turn['role']!r}; known roles: {', '.join(ROLES)}")
        turns.append((turn["role"], turn["content"]))
    last_user = max((i for i, (role, _) in enumerate(turns) if role == "user"), default=None)
    if last_user is None:
        raise ValueError(f"{where}: the conversation has no user turn (roles: {[role for role, _ in turns]})")
    after = turns[last_user + 1] if last_user + 1 < len(turns) else None
    reply = after[1] if after is not None and after[0] == "assistant" and after[1].strip() else None
    return tuple(turns[: last_user + 1]), reply


def messages_text(turns: Sequence[tuple[str, str]]) -> str:
    """The prompt text of chat turns: the content of a lone user turn, else `role: content` paragraphs."""
    if len(turns) == 1:
        return turns[0][1]
    return "\n\n".join(f"{role}: {content}" for role, content in turns)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
