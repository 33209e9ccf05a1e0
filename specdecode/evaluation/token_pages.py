"""The evaluation's token pages: `tokens-<domain>.html`, a few held-out prompts decoded greedily at batch
1 by the routed method (else generic), each token coloured by how it came; untimed, in no row."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdecode.core.atomic import write_atomic
from specdecode.evaluation.config import EvalConfig
from specdecode.routing.generate import generate_with
from specdecode.watch.render import Answer, pieces, token_page


def page_methods(cfg: EvalConfig, models: Any, texts: list[str], router_key: Callable[[str], str]) -> list[str]:
    """The method each prompt's page shows: the router's choice with `routed`, else `generic`, else none."""
    if "routed" in cfg.methods and models.router is not None:
        return [router_key(choice) for choice in models.router.choose(texts)]
    return ["generic"] * len(texts) if "generic" in models.drafters else []


def write_token_pages(
    cfg: EvalConfig, models: Any, domain: str, texts: list[str], ids: list[list[int]], router_key: Callable[[str], str]
) -> Path | None:
    """Decode `ids` with the record on and write `tokens-<domain>.html`; None where no method is shown."""
    methods = page_methods(cfg, models, texts, router_key)
    if not methods:
        return None
    answers = []
    for text, prompt, method in zip(texts, ids, methods):
        decode: dict[str, Any] = dict(
            max_new_tokens=cfg.max_new_tokens, eos_token_ids=models.eos, seed=cfg.seed, record=True
        )
        drafter = None if method == "autoregressive" else models.drafters[method]
        result = generate_with(
            models.target, drafter, [prompt], gamma=cfg.gamma, prompt_lookup=cfg.prompt_lookup, **decode
        )
        assert result.record is not None  # record=True
        row = result.record[0]
        answers.append(Answer(text, method, pieces(models.tokenizer, row), row.tau, result.stats.tokens_per_s))
    shown = "the router's choice per prompt" if "routed" in cfg.methods and models.router is not None else "generic"
    note = (
        f"Greedy, batch 1, up to {cfg.max_new_tokens} new tokens, drafter: {shown}. "
        "Tokens/s here are of these single decodes (record on), not the report's rows."
    )
    path = Path(cfg.output_dir) / f"tokens-{domain}.html"
    write_atomic(path, token_page(f"How each token came: {domain}", answers, note))
    return path


def token_page_links(out_dir: Path) -> list[str]:
    """report.md's lines linking the token pages in `out_dir`; none without a page."""
    pages = sorted(out_dir.glob("tokens-*.html"))
    if not pages:
        return []
    links = ", ".join(f"[{p.stem.removeprefix('tokens-')}]({p.name})" for p in pages)
    return [f"How each token came, per domain (accepted, looked up, corrected, bonus): {links}", ""]
