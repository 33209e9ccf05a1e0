"""Evaluation suite: what speculative decoding buys per domain, per drafter, per setting.

For each domain's held-out prompts, each temperature and batch size, each method is run for real:
`autoregressive` (the baseline), `undistilled` (a derived drafter before training), `generic`
(distilled on the mix), `specialized:<domain>` (each domain drafter, on every domain), `routed`
(the router picks a drafter per prompt), and `oracle` (per prompt, the drafter that realised the
highest acceptance at batch 1). Rows report alpha, tau, tokens/s, speedup over autoregressive at
the same batch size, and exact match with target-only greedy (measured, never assumed).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from specdecode.config import MAX_GAMMA, DrafterConfig, TargetConfig, _require
from specdecode.data import DOMAINS, format_prompt, load_domain
from specdecode.locking import locks_output_dir
from specdecode.stats import GenerationResult

Generate = Callable[[list[list[int]]], GenerationResult]


@dataclass
class EvalConfig:
    """eval/acceptance.py. `drafters` maps a name (`generic`, or a domain for its specialised
    drafter) to a drafter folder; `router_dir` is a fitted router folder (enables `routed`)."""

    target: TargetConfig = field(default_factory=TargetConfig)
    undistilled: DrafterConfig = field(default_factory=DrafterConfig)
    drafters: dict[str, str] = field(default_factory=dict)
    router_dir: str | None = None
    domains: list[str] = field(default_factory=lambda: list(DOMAINS))
    # Where prompts come from: the embedded held-out splits, or "synthetic" for smoke runs.
    source: str = "embedded"
    methods: list[str] = field(
        default_factory=lambda: ["autoregressive", "undistilled", "generic", "specialized", "routed", "oracle"]
    )
    prompts_per_domain: int = 10
    max_prompt_tokens: int = 256
    max_new_tokens: int = 64
    # null: each drafter at the gamma stored with it by training (specdecode.decode.drafter_gamma).
    gamma: int | None = 4
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    seed: int = 0
    output_dir: str = "outputs/eval"

    def __post_init__(self) -> None:
        known = {"autoregressive", "undistilled", "generic", "specialized", "routed", "oracle"}
        for method in self.methods:
            _require(method in known, "methods", method, f"one of {sorted(known)}")
        for domain in self.domains:
            _require(domain in DOMAINS, "domains", domain, f"one of {list(DOMAINS)}")
        _require("autoregressive" in self.methods, "methods", self.methods, "must include autoregressive (the baseline)")
        if "generic" in self.methods:
            _require("generic" in self.drafters, "drafters.generic", None, "method generic needs a drafter folder")
        if "routed" in self.methods:
            _require(bool(self.router_dir), "router_dir", self.router_dir, "method routed needs a fitted router folder")
        for name, path in self.drafters.items():
            _require(name == "generic" or name in DOMAINS, "drafters", name, f"generic or one of {list(DOMAINS)}")
            _require(Path(path).exists(), f"drafters.{name}", path, "does not exist")
        _require(self.prompts_per_domain >= 1, "prompts_per_domain", self.prompts_per_domain, ">= 1")
        _require(self.gamma is None or (isinstance(self.gamma, int) and 1 <= self.gamma <= MAX_GAMMA), "gamma", self.gamma,
                 f"null (each drafter's own) or an int in [1, {MAX_GAMMA}]")
        _require(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, ">= 1")
        for t in self.temperatures:
            _require(isinstance(t, (int, float)) and math.isfinite(t) and t >= 0, "temperatures", t, "finite numbers >= 0")
        for b in self.batch_sizes:
            _require(isinstance(b, int) and b >= 1, "batch_sizes", b, "ints >= 1")


@dataclass
class RunRecord:
    """One method's decode of one prompt set: its batches' results, and for each prompt (in the
    caller's order) its position among the batches' concatenated sequences."""

    results: list[GenerationResult]
    order: list[int] | None = None
    # Work outside decoding that the method pays for (the router's embedding and MLP).
    extra_seconds: float = 0.0

    @property
    def sequences(self) -> list[list[int]]:
        flat = [s for r in self.results for s in r.sequences]
        return flat if self.order is None else [flat[i] for i in self.order]

    @property
    def tokens(self) -> int:
        return sum(r.stats.generated_tokens for r in self.results)

    @property
    def seconds(self) -> float:
        return sum(r.stats.wall_time_s for r in self.results) + self.extra_seconds

    def counts(self, reference: list[list[int]] | None) -> dict:
        """Raw, summable counts (what processes gather before rows are computed)."""
        gamma = max(r.stats.gamma for r in self.results)
        reached, passed = [0] * gamma, [0] * gamma
        for r in self.results:
            histogram = r.stats.accepted_length_histogram
            for i in range(r.stats.gamma):
                reached[i] += sum(histogram[i:])
                passed[i] += sum(histogram[i + 1 :])
        sequences = self.sequences
        return {
            "tokens": self.tokens,
            "seconds": self.seconds,
            "accepted": sum(r.stats.accepted for r in self.results),
            "rejections": sum(r.stats.rejections for r in self.results),
            "row_calls": sum(r.stats.generated_tokens / r.stats.tau for r in self.results if r.stats.tau),
            "reached": reached,
            "passed": passed,
            "prompts": len(sequences),
            "gamma": gamma,
            "matches": sum(a == b for a, b in zip(sequences, reference)) if reference is not None else None,
        }


def merge_counts(parts: list[dict]) -> dict:
    """Counts of one (domain, method, setting) from several processes. They ran concurrently, so
    wall time is the slowest process's, and tokens/s is the whole system's throughput."""
    merged = dict(parts[0])
    for part in parts[1:]:
        for key in ("tokens", "accepted", "rejections", "row_calls", "prompts"):
            merged[key] += part[key]
        merged["seconds"] = max(merged["seconds"], part["seconds"])
        merged["reached"] = [a + b for a, b in zip(merged["reached"], part["reached"])]
        merged["passed"] = [a + b for a, b in zip(merged["passed"], part["passed"])]
        merged["matches"] = None if merged["matches"] is None else merged["matches"] + part["matches"]
    return merged


def run_batched(generate: Generate, prompts: list[list[int]], batch_size: int) -> RunRecord:
    """Decode `prompts` in consecutive batches of `batch_size`."""
    return RunRecord([generate(prompts[i : i + batch_size]) for i in range(0, len(prompts), batch_size)])


def run_grouped(generators: dict[str, Generate], choices: list[str], prompts: list[list[int]], batch_size: int) -> RunRecord:
    """Decode each prompt with its chosen method, batching prompts that share a choice.

    At batch B this is what a deployment that groups requests by drafter does. Sequences come
    back in prompt order.
    """
    by_choice: dict[str, list[int]] = {}
    for i, choice in enumerate(choices):
        by_choice.setdefault(choice, []).append(i)
    results, flat_index = [], []
    for choice, members in by_choice.items():
        for start in range(0, len(members), batch_size):
            chunk = members[start : start + batch_size]
            results.append(generators[choice]([prompts[i] for i in chunk]))
            flat_index += chunk
    position = {prompt: k for k, prompt in enumerate(flat_index)}
    return RunRecord(results, order=[position[i] for i in range(len(prompts))])


def pick_per_prompt(records: dict[str, RunRecord]) -> list[str]:
    """The oracle's choice: for each prompt, the method whose batch-1 run realised the highest tau
    (tokens per target call), ties to the first listed. Needs batch-1 records (one result per prompt)."""
    names = list(records)
    count = len(records[names[0]].results)
    return [max(names, key=lambda n: records[n].results[i].stats.tau) for i in range(count)]


def heldout_prompts(
    tokenizer: PreTrainedTokenizerBase, domain: str, count: int, max_tokens: int, source: str = "embedded"
) -> list[tuple[str, list[int]]]:
    """The first `count` held-out prompts of `domain` that fit `max_tokens` (skipped, never cut)."""
    chosen = []
    for example in load_domain(domain, source=source, split="heldout"):  # type: ignore[arg-type]
        ids = format_prompt(tokenizer, example.prompt)
        if len(ids) <= max_tokens:
            chosen.append((example.prompt, ids))
        if len(chosen) == count:
            return chosen
    raise ValueError(f"domain {domain!r} has only {len(chosen)} held-out prompts within max_prompt_tokens={max_tokens}")


def finalize_rows(keyed_counts: dict[tuple, dict], gamma: int | None) -> list[dict]:
    """results.json rows from merged counts keyed by (domain, method, temperature, batch_size);
    `gamma=None`: each drafter ran at its own stored gamma, which the counts carry."""
    rows = []
    for (domain, method, temperature, batch_size), c in keyed_counts.items():
        base = keyed_counts[(domain, "autoregressive", temperature, batch_size)]
        tokens_per_s = c["tokens"] / c["seconds"] if c["seconds"] else 0.0
        base_tps = base["tokens"] / base["seconds"] if base["seconds"] else 0.0
        judged = c["accepted"] + c["rejections"]
        rows.append(
            {
                "domain": domain,
                "method": method,
                "gamma": 0 if method == "autoregressive" else (gamma if gamma is not None else c["gamma"]),
                "temperature": temperature,
                "batch_size": batch_size,
                "alpha": c["accepted"] / judged if judged else None,
                "tau": c["tokens"] / c["row_calls"] if c["row_calls"] else None,
                "tokens_per_s": tokens_per_s,
                "speedup": tokens_per_s / base_tps if base_tps else None,
                "exact_match": c["matches"] / c["prompts"] if c["matches"] is not None else None,
                "position_acceptance": [p / r if r else None for p, r in zip(c["passed"], c["reached"])],
                "tokens": c["tokens"],
                "seconds": c["seconds"],
                "prompts": c["prompts"],
            }
        )
    return rows


@locks_output_dir
def run_eval(cfg: EvalConfig, router_loader: Callable[[str], object] | None = None) -> dict:
    """Evaluate every method on every domain and setting; write results.json and report.md.

    Under `accelerate launch`, each process decodes its share of each domain's prompts and the
    main process gathers the counts and writes the files (alpha, tau and exact match do not depend
    on the number of processes; tokens/s is then the whole system's throughput).
    """
    from functools import partial

    from accelerate import Accelerator

    from specdecode.benchmark import vocab_corpus
    from specdecode.decode import autoregressive_generate, speculative_generate
    from specdecode.models import build_drafter, check_tokenizers, load_model
    from specdecode.report import write_report
    from specdecode.validation import default_eos

    accelerator = Accelerator(cpu=cfg.target.device == "cpu")
    device = accelerator.device if cfg.target.device != "cpu" else "cpu"
    target, tokenizer = load_model(cfg.target.name, dtype=cfg.target.dtype, device=device)
    drafters: dict[str, object] = {}
    if "undistilled" in cfg.methods:
        drafters["undistilled"] = build_drafter(cfg.undistilled, target, tokenizer, lambda: vocab_corpus(tokenizer, 2000, source=cfg.source, domains=cfg.domains))
    for name, path in cfg.drafters.items():
        if name == "generic" and "generic" not in cfg.methods:
            continue
        if name != "generic" and "specialized" not in cfg.methods:
            continue
        model, drafter_tokenizer = load_model(path, dtype=cfg.target.dtype, device=device)
        check_tokenizers(tokenizer, drafter_tokenizer)
        drafters["generic" if name == "generic" else f"specialized:{name}"] = model
    router = None
    if "routed" in cfg.methods:
        if router_loader is None:
            from specdecode.router import Router

            router_loader = Router.load
        router = router_loader(cfg.router_dir)
    candidates = [n for n in drafters if n == "generic" or n.startswith("specialized:")]
    eos = default_eos(target)

    settings = [(t, b) for t in cfg.temperatures for b in sorted(cfg.batch_sizes)]
    progress = tqdm(total=len(cfg.domains) * len(settings), desc="eval", disable=not accelerator.is_main_process)
    local: dict[tuple, dict] = {}
    routing_seconds: dict[str, float] = {}
    for domain in cfg.domains:
        prompts = heldout_prompts(tokenizer, domain, cfg.prompts_per_domain, cfg.max_prompt_tokens, cfg.source)
        with accelerator.split_between_processes(prompts) as mine:
            texts, ids = [t for t, _ in mine], [p for _, p in mine]
            for temperature in cfg.temperatures:
                decode = dict(max_new_tokens=cfg.max_new_tokens, temperature=temperature, eos_token_ids=eos, seed=cfg.seed)
                generators: dict[str, Generate] = {"autoregressive": partial(autoregressive_generate, target, **decode)}
                for name, drafter in drafters.items():
                    generators[name] = partial(speculative_generate, target, drafter, gamma=cfg.gamma, **decode)
                route_choices: list[str] | None = None
                if router is not None:
                    start = time.perf_counter()
                    route_choices = [_router_key(c) for c in router.choose(texts)]  # type: ignore[attr-defined]
                    routing_seconds[domain] = (time.perf_counter() - start) / max(len(texts), 1)
                oracle_choices: list[str] | None = None
                for batch_size in sorted(cfg.batch_sizes):
                    progress.set_postfix_str(f"{domain} T={temperature} B={batch_size}")
                    records = {name: run_batched(fn, ids, batch_size) for name, fn in generators.items()}
                    if route_choices is not None:
                        records["routed"] = run_grouped(generators, route_choices, ids, batch_size)
                        # Routing is part of the routed method's cost.
                        records["routed"].extra_seconds = routing_seconds[domain] * len(ids)
                    if "oracle" in cfg.methods and candidates:
                        if oracle_choices is None:
                            if batch_size != 1:
                                raise ValueError("method oracle needs batch size 1 in batch_sizes (it picks from batch-1 runs)")
                            oracle_choices = pick_per_prompt({n: records[n] for n in candidates})
                            records["oracle"] = RunRecord([records[c].results[i] for i, c in enumerate(oracle_choices)])
                        else:
                            records["oracle"] = run_grouped(generators, oracle_choices, ids, batch_size)
                    reference = records["autoregressive"].sequences if temperature == 0.0 else None
                    for name, record in records.items():
                        local[(domain, name, temperature, batch_size)] = record.counts(reference)
                    progress.update(1)
    progress.close()

    gathered = accelerator.gather_for_metrics([local], use_gather_object=True)
    results: dict = {}
    if accelerator.is_main_process:
        keys = list(gathered[0])
        merged = {key: merge_counts([part[key] for part in gathered]) for key in keys}
        rows = finalize_rows(merged, cfg.gamma)
        results = {
            "config": asdict(cfg),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "processes": accelerator.num_processes,
            "routing_seconds_per_prompt": routing_seconds,
            "rows": rows,
        }
        out = Path(cfg.output_dir)
        from specdecode.atomic import write_atomic

        write_atomic(out / "results.json", json.dumps(results, indent=2))
        write_report(results, out)
    accelerator.wait_for_everyone()
    return results


def _router_key(drafter_name: str) -> str:
    """Router drafter names are `generic` or a domain; evaluation methods name them as rows do."""
    from specdecode.router import NO_DRAFTER

    if drafter_name == NO_DRAFTER:
        return "autoregressive"
    return drafter_name if drafter_name in ("generic", "undistilled") else f"specialized:{drafter_name}"
