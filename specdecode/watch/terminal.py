"""The watch in a terminal: each answer with its tokens coloured by how they came; or, with
`serve=true`, the local web page."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import TextIO

from specdecode.routing.router import Router
from specdecode.watch.render import Answer, ansi, ansi_legend
from specdecode.watch.server import serve_forever
from specdecode.watch.watcher import WatchConfig, load_watcher


def format_answer(answer: Answer) -> str:
    """The terminal view of one answer: the prompt, the coloured answer, the summary line."""
    return f"\n> {answer.prompt}\n{ansi(answer.tokens)}\n[{answer.summary()}]\n"


def typed_prompts(stdin: TextIO, out: TextIO) -> Iterable[str]:
    """Prompts typed one per line until end of input (an empty line is skipped)."""
    while True:
        if stdin.isatty():
            out.write("prompt> ")
            out.flush()
        line = stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.strip()


def run_watch(
    cfg: WatchConfig,
    stdin: TextIO = sys.stdin,
    out: TextIO = sys.stdout,
    router_loader: Callable[[str], Router] | None = None,
) -> list[Answer]:
    """Print each prompt's coloured answer (`cfg.prompts`, else the lines typed on `stdin`), or
    with `cfg.serve` serve the web page until interrupted; return the answers printed."""
    watcher = load_watcher(cfg, router_loader)
    if cfg.serve:
        serve_forever(watcher, cfg.host, cfg.port, out)
        return []
    out.write(ansi_legend() + "\n")
    answers = []
    for text in cfg.prompts or typed_prompts(stdin, out):
        answers.append(watcher.answer(text, compare=cfg.compare))
        out.write(format_answer(answers[-1]))
        out.flush()
    return answers
