"""Watch speculative decoding work (eval/watch.py, conf/watch.yaml): its config, and the loaded
models that answer a prompt routed, with the per-token record, tau and tokens/s against the target
alone. The drafters: a fitted router's, a demo's, one drafter folder, or `drafter` built untrained.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from specdecode.core.config import (
    GAMMA_RANGE,
    TEMPERATURE_RANGE,
    Placement,
    is_gamma,
    is_temperature,
    require,
    require_ints,
)
from specdecode.core.devices import resolve_device
from specdecode.data.corpus import VOCAB_CORPUS_DOCS, vocab_corpus
from specdecode.data.domains import format_prompt
from specdecode.decoding.lookup import PromptLookup
from specdecode.decoding.record import StepEvent
from specdecode.decoding.stats import GenerationResult
from specdecode.models.compat import default_eos
from specdecode.models.config import DrafterConfig, TargetConfig
from specdecode.models.loading import build_drafter, load_drafters, load_target
from specdecode.routing.generate import generate_with, match_drafters
from specdecode.routing.router import NO_DRAFTER, Router
from specdecode.watch.render import Answer, pieces


@dataclass
class WatchConfig(Placement):
    """eval/watch.py: see the module docstring; conf/watch.yaml comments each field."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=lambda: DrafterConfig(draft_vocab=None))
    drafters: dict[str, str] = field(default_factory=dict)
    router_dir: str | None = None
    demo_dir: str | None = None
    prompts: list[str] = field(default_factory=list)
    max_new_tokens: int = 128
    temperature: float = 0.0
    gamma: int | None = None
    prompt_lookup: PromptLookup = field(default_factory=PromptLookup)
    seed: int = 0
    compare: bool = True
    serve: bool = False
    host: str = "127.0.0.1"
    port: int = 8000

    def __post_init__(self) -> None:
        self.check_placement()
        require(self.compile is not True, "compile", self.compile, "null or false: the watch records every step")
        if self.demo_dir is not None:
            require(
                self.router_dir is None and not self.drafters,
                "demo_dir",
                self.demo_dir,
                "alone: it names the router and the drafters (drop router_dir and drafters)",
            )
            require((Path(self.demo_dir) / "fit").is_dir(), "demo_dir", self.demo_dir, "a demo folder with fit/")
        if self.router_dir is not None:
            require(Path(self.router_dir).is_dir(), "router_dir", self.router_dir, "does not exist")
            require(bool(self.drafters), "drafters", self.drafters, "the router's drafter folders, by name")
        else:
            require(len(self.drafters) <= 1, "drafters", self.drafters, "one drafter folder without router_dir")
        for name, path in self.drafters.items():
            require(Path(path).exists(), f"drafters.{name}", path, "does not exist")
        require_ints(self, "max_new_tokens")
        require(is_temperature(self.temperature), "temperature", self.temperature, TEMPERATURE_RANGE)
        require(self.gamma is None or is_gamma(self.gamma), "gamma", self.gamma, f"null or {GAMMA_RANGE}")
        require(0 <= self.port <= 65535, "port", self.port, "in [0, 65535] (0: any free port)")


class Watcher:
    """The loaded target, drafters and router, and one prompt's answer the way the views show it."""

    def __init__(
        self,
        target: Any,
        tokenizer: PreTrainedTokenizerBase,
        drafters: dict[str, Any],
        router: Router | None = None,
        **decode: Any,
    ) -> None:
        self.target, self.tokenizer, self.drafters, self.router = target, tokenizer, drafters, router
        # max_new_tokens, temperature, seed, gamma, prompt_lookup
        self.decode_kwargs = decode

    def choose(self, text: str) -> tuple[str, float]:
        """The drafter for `text` (the router's choice, or the one drafter) and the routing seconds."""
        if self.router is None:
            return next(iter(self.drafters)), 0.0
        start = time.perf_counter()
        name = self.router.choose([text])[0]
        return name, time.perf_counter() - start

    def prompt_ids(self, text: str) -> list[int]:
        return format_prompt(self.tokenizer, text)

    def decode(
        self,
        ids: list[int],
        drafter: str,
        *,
        record: bool = False,
        on_step: Callable[[StepEvent], None] | None = None,
        max_new_tokens: int | None = None,
    ) -> GenerationResult:
        """`ids` decoded with `drafters[drafter]`, or the target alone for `none`."""
        kwargs = dict(self.decode_kwargs) | {"eos_token_ids": default_eos(self.target)}
        if max_new_tokens is not None:
            kwargs["max_new_tokens"] = max_new_tokens
        model = None if drafter == NO_DRAFTER else self.drafters[drafter]
        return generate_with(self.target, model, [ids], record=record, on_step=on_step, **kwargs)

    def answer(self, text: str, compare: bool = True) -> Answer:
        """`text` decoded with its drafter (record on), and with the target alone when `compare`."""
        name, _ = self.choose(text)
        ids = self.prompt_ids(text)
        result = self.decode(ids, name, record=True)
        assert result.record is not None
        row = result.record[0]
        alone = self.decode(ids, NO_DRAFTER).stats.tokens_per_s if compare else None
        return Answer(text, name, pieces(self.tokenizer, row), row.tau, result.stats.tokens_per_s, alone)

    def warm_up(self) -> None:
        """Decode a few tokens with each drafter and the target alone, untimed: first passes pay one-off costs."""
        ids = self.prompt_ids("Hello")
        for name in [*self.drafters, NO_DRAFTER]:
            self.decode(ids, name, max_new_tokens=8)


def demo_drafter_dir(root: Path, name: str) -> Path:
    """Where the demo under `root` writes drafter `name` (`generic`: the mix's job)."""
    return root / f"distill-{'mix' if name == 'generic' else name}" / "drafter"


def drafter_folders(cfg: WatchConfig, router: Router | None) -> dict[str, str]:
    """The drafter folders by name: `cfg.drafters`, or a demo's for the drafters its router routes to."""
    if cfg.demo_dir is None:
        return dict(cfg.drafters)
    assert router is not None
    root = Path(cfg.demo_dir)
    folders = {name: str(demo_drafter_dir(root, name)) for name in router.drafters if name != NO_DRAFTER}
    for name, path in folders.items():
        require(Path(path).is_dir(), f"the drafter {name!r} of demo_dir", path, "does not exist")
    return folders


def load_watcher(cfg: WatchConfig, router_loader: Callable[[str], Router] | None = None) -> Watcher:
    """The target, the drafters and the router `cfg` names, warmed up."""
    device = resolve_device(cfg.device)
    target, tokenizer = load_target(cfg.target, dtype=cfg.dtype, device=device, skinny_matmul=cfg.skinny_matmul)
    router_dir = str(Path(cfg.demo_dir) / "fit") if cfg.demo_dir is not None else cfg.router_dir
    router = None
    if router_dir is not None:
        router = (router_loader or (lambda path: Router.load(path, device=str(device))))(router_dir)
    drafters: dict[str, Any] = dict(load_drafters(drafter_folders(cfg, router), target, tokenizer))
    if router is not None:
        match_drafters(router, drafters)
    if not drafters:
        name = str(cfg.drafter.path) if cfg.drafter.kind == "pretrained" else f"untrained {cfg.drafter.kind}"
        drafters[name] = build_drafter(
            cfg.drafter, target, tokenizer, lambda: vocab_corpus(tokenizer, VOCAB_CORPUS_DOCS)
        )
    watcher = Watcher(
        target,
        tokenizer,
        drafters,
        router,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        seed=cfg.seed,
        gamma=cfg.gamma,
        prompt_lookup=cfg.prompt_lookup,
    )
    watcher.warm_up()
    return watcher
