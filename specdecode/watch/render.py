"""How each token of an answer came (the kinds of `decoding.record`), shown in colour: in a terminal
(ANSI) and as a self-contained HTML page."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from specdecode.decoding.record import KINDS, RowRecord


@dataclass(frozen=True)
class KindStyle:
    label: str
    meaning: str
    background: str  # CSS colour of the token's background
    ansi: str  # SGR code of the token's colour in a terminal


STYLES: dict[str, KindStyle] = {
    "accepted": KindStyle("accepted", "the drafter's token, accepted by the target", "#b9f6ca", "32"),
    "looked_up": KindStyle("looked up", "copied from earlier text (prompt lookup), accepted", "#b3e5fc", "36"),
    "corrected": KindStyle("corrected", "the target's token where it rejected a draft", "#ffcdd2", "31"),
    "bonus": KindStyle("bonus", "the target's extra token after accepting every draft", "#ffe082", "33"),
    "target": KindStyle("target", "the target alone (its first token, or no drafter)", "#e0e0e0", "0"),
}
assert tuple(STYLES) == KINDS


class PieceDecoder:
    """Token ids → the text each adds, decoded as a prefix of the whole answer, so that a token ending
    inside a character adds nothing and the next adds the whole character."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self.flush(held=True)

    def flush(self, held: bool = False) -> str:
        """The text not yet returned; with `held`, none while it ends inside a character."""
        text = str(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        if held and text.endswith("\ufffd"):
            return ""
        piece, self.text = text[len(self.text) :], text
        return piece


def pieces(tokenizer: PreTrainedTokenizerBase, record: RowRecord) -> list[tuple[str, str]]:
    """A row's generated tokens as (text, kind) pairs, whose texts join to the decoded answer."""
    decoder = PieceDecoder(tokenizer)
    out = [(decoder.push(token), kind) for token, kind in record.tokens()]
    if out:
        out[-1] = (out[-1][0] + decoder.flush(), out[-1][1])
    return out


def ansi(tokens: Sequence[tuple[str, str]]) -> str:
    """(text, kind) pairs as terminal text, each token in its kind's colour."""
    return "".join(f"\x1b[{STYLES[kind].ansi}m{text}\x1b[0m" if text else "" for text, kind in tokens)


def ansi_legend() -> str:
    return "  ".join(f"\x1b[{s.ansi}m■ {s.label}\x1b[0m" for s in STYLES.values())


@dataclass
class Answer:
    """One prompt's answer as a view shows it, with the target alone's tokens/s where measured."""

    prompt: str
    drafter: str
    tokens: list[tuple[str, str]]
    tau: float
    tokens_per_s: float
    target_tokens_per_s: float | None = None

    @property
    def speedup(self) -> float | None:
        return self.tokens_per_s / self.target_tokens_per_s if self.target_tokens_per_s else None

    def summary(self) -> str:
        """One line: drafter, tau, tokens/s against the target alone."""
        line = f"drafter {self.drafter} · tau {self.tau:.2f} · speculative {self.tokens_per_s:.1f} tokens/s"
        if self.target_tokens_per_s:
            line += f" · target alone {self.target_tokens_per_s:.1f} tokens/s · {self.speedup:.2f}×"
        return line


# The page's style sheet: the kinds' colours, tokens kept inline with their whitespace.
CSS = "\n".join(
    [
        "body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#212121}",
        ".answer{font-family:ui-monospace,monospace;white-space:pre-wrap;line-height:1.7;border:1px solid #ccc;"
        "border-radius:6px;padding:.8rem;min-height:3rem}",
        ".prompt{white-space:pre-wrap;color:#555;border-left:3px solid #ccc;padding-left:.6rem}",
        ".summary{color:#444;font-size:.9rem}",
        ".legend span{margin-right:1rem;padding:.1rem .4rem;border-radius:3px}",
        "span.t{border-radius:2px}",
        *(f".k-{kind}{{background:{style.background}}}" for kind, style in STYLES.items()),
    ]
)


def token_spans(tokens: Sequence[tuple[str, str]]) -> str:
    """(text, kind) pairs as HTML spans of class `t k-<kind>` (the text escaped)."""
    return "".join(f'<span class="t k-{kind}" title="{kind}">{html.escape(text)}</span>' for text, kind in tokens)


def legend_html() -> str:
    items = "".join(
        f'<span class="k-{kind}" title="{html.escape(s.meaning)}">{s.label}: {html.escape(s.meaning)}</span> '
        for kind, s in STYLES.items()
    )
    return f'<p class="legend">{items}</p>'


def token_page(title: str, answers: Sequence[Answer], note: str = "") -> str:
    """A self-contained HTML page: a legend, then each answer's prompt, summary and coloured tokens."""
    parts = [
        "<!doctype html>",
        f'<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>',
        f"<style>{CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>{html.escape(note)}</p>" if note else "",
        legend_html(),
    ]
    for i, answer in enumerate(answers, 1):
        parts += [
            f"<h2>Prompt {i}</h2>",
            f'<div class="prompt">{html.escape(answer.prompt)}</div>',
            f'<p class="summary">{html.escape(answer.summary())}</p>',
            f'<div class="answer">{token_spans(answer.tokens)}</div>',
        ]
    parts.append("</body></html>")
    return "\n".join(parts)
