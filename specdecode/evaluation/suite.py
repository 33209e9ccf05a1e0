"""Evaluation suite: what speculative decoding buys per domain, per drafter, per setting. Each method
(conf/eval.yaml) runs for real on each domain's held-out prompts, temperature and batch size; rows
report alpha, tau, tokens/s, speedup over autoregressive and exact match with target-only greedy,
and a domain of several kinds also gets rows per kind (`mixed/<kind>`).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from specdecode.core.atomic import write_atomic
from specdecode.core.devices import placed_accelerator
from specdecode.core.locking import locks_output_dir
from specdecode.core.tracking import check_tracker_installed, start_tracking
from specdecode.data.corpus import VOCAB_CORPUS_DOCS, vocab_corpus
from specdecode.data.domains import prompts_within
from specdecode.data.registry import domain_examples, require_heldout
from specdecode.decoding.compiled import resolve_compile
from specdecode.decoding.costs import COST_MAX_GAMMA
from specdecode.decoding.decode import (
    AUTO,
    adaptive_gamma,
    autoregressive_generate,
    drafter_gamma,
    speculative_generate,
)
from specdecode.decoding.lookup import PromptLookup
from specdecode.decoding.sampling import SamplingParams
from specdecode.decoding.static_cache import static_capacity
from specdecode.decoding.stats import GenerationResult
from specdecode.decoding.timing import measure_pass_costs, warm_up_tokens
from specdecode.evaluation.config import EvalConfig
from specdecode.evaluation.records import (
    ROUTED_CHOICES,
    Generate,
    Route,
    RunRecord,
    composed,
    filled,
    finalize_rows,
    median_rounds,
    merge_counts,
    pick_per_prompt,
    router_share,
    run_batched,
    run_interleaved,
    settled,
)
from specdecode.evaluation.report import write_report
from specdecode.evaluation.token_pages import write_token_pages
from specdecode.evaluation.tracker import log_results
from specdecode.models.compat import default_eos
from specdecode.models.cpu_matmul import kernel_picks
from specdecode.models.loading import build_drafter, load_drafters, load_target, load_tokenizer
from specdecode.routing.router import NO_DRAFTER, Router


def heldout_prompts(
    tokenizer: PreTrainedTokenizerBase, data: Mapping[str, Any], count: int, max_tokens: int
) -> list[tuple[str, list[int]]]:
    """The first `count` held-out prompts within `max_tokens` (skipped, never cut), as (text, ids)."""
    fitting = prompts_within(tokenizer, domain_examples(data, "heldout"), max_tokens)
    chosen = [(example.prompt, ids) for example, ids in itertools.islice(fitting, count)]
    if len(chosen) == count:
        return chosen
    raise ValueError(
        f"domain {data['name']!r} has only {len(chosen)} held-out prompts within max_prompt_tokens={max_tokens}, and "
        f"prompts_per_domain={count} are needed: raise max_prompt_tokens or lower prompts_per_domain"
    )


def kind_shares(
    data: Mapping[str, Any], prompts: list[tuple[str, list[int]]], batch1: int
) -> list[tuple[str, list[tuple[str, list[int]]], int]]:
    """A domain's `prompts` whole (`<domain>`) and, where they are of several kinds, each kind's
    (`<domain>/<kind>`), as (name, prompts, how many of them are among the whole's first `batch1`)."""
    domain = data["name"]
    kinds = {example.prompt: example.kind for example in domain_examples(data, "heldout")}
    shares = [(domain, prompts, batch1)]
    for kind in dict.fromkeys(kinds[text] for text, _ in prompts if kinds[text] is not None):
        mine = [i for i, (text, _) in enumerate(prompts) if kinds[text] == kind]
        shares.append((f"{domain}/{kind}", [prompts[i] for i in mine], sum(1 for i in mine if i < batch1)))
    return shares


def check_heldout_prompts(cfg: EvalConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """Every domain has `prompts_per_domain` held-out prompts within `max_prompt_tokens` (`heldout_prompts`)."""
    for domain in cfg.domains:
        heldout_prompts(tokenizer, cfg.data[domain], cfg.prompts_per_domain, cfg.max_prompt_tokens)


@dataclass
class _Models:
    """What an evaluation decodes with: the drafters by method name, and the router if any."""

    target: Any
    tokenizer: PreTrainedTokenizerBase
    eos: list[int]
    drafters: dict[str, Any]
    router: Any = None
    # candidate → one of its passes in target steps, timed when the oracle first picks.
    pass_costs: dict[str, float] | None = None
    # method → seconds its decodes spent compiling (`records.settled`)
    compile_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def candidates(self) -> list[str]:
        """The trained drafters the router and the oracle choose between (not `alldata`)."""
        return [n for n in self.drafters if n == "generic" or n.startswith("specialized:")]


def _load_models(cfg: EvalConfig, device: Any, router_loader: Callable[[str], object] | None) -> _Models:
    router = None
    if _ROUTED & set(cfg.methods):
        if router_loader is None:
            router_loader = partial(Router.load, device=str(device))
        router = router_loader(cfg.router_dir)  # type: ignore[arg-type]  # router_dir is checked set when routed is asked for
        # The router may choose any drafter it was fitted on: each must be one this run loads.
        known = {"autoregressive", *map(_method_name, cfg.drafters)} | ({"undistilled"} & set(cfg.methods))
        missing = [name for name in router.drafters if _router_key(name) not in known]  # type: ignore[attr-defined]  # the loader returns a Router (tests pass stand-ins)
        if missing:
            raise ValueError(
                f"router_dir={cfg.router_dir!r} routes to {missing}, which drafters lacks "
                f"(it has {sorted(cfg.drafters)}): add +drafters.<name>=<folder> for each"
            )
    target, tokenizer = load_target(cfg.target, dtype=cfg.dtype, device=device, skinny_matmul=cfg.skinny_matmul)
    drafters: dict[str, Any] = {}
    if "undistilled" in cfg.methods:
        corpus = partial(vocab_corpus, tokenizer, VOCAB_CORPUS_DOCS, cfg.data)
        drafters["undistilled"] = build_drafter(cfg.undistilled, target, tokenizer, corpus)
    # The router's and the oracle's candidates load even where their own rows were not asked for.
    choosers = (_ROUTED | {"oracle"}) & set(cfg.methods)
    wanted = {name: path for name, path in cfg.drafters.items() if _family(name) in cfg.methods or choosers}
    drafters |= {_method_name(name): model for name, model in load_drafters(wanted, target, tokenizer).items()}
    return _Models(target, tokenizer, default_eos(target), drafters, router)


# The methods that decode the router's choices: in mixed batches, and grouped by chosen drafter.
_ROUTED = {"routed", "routed_grouped"}


def _method_name(drafter: str) -> str:
    """The method a trained drafter of `cfg.drafters` decodes as: `generic`, `alldata` or `specialized:<name>`."""
    return drafter if drafter in ("generic", "alldata") else f"specialized:{drafter}"


def _family(name: str) -> str:
    """The method a generator's rows belong to (`specialized` for `code` / `specialized:code`)."""
    return name if name in ("autoregressive", "undistilled", "generic", "alldata") else "specialized"


def _decode(cfg: EvalConfig, models: _Models, temperature: float, max_new_tokens: int, eos: list[int]) -> dict:
    """Every method's decode keywords, on the core `compile` asks for: the eager loop, or the compiled
    static core with one cache capacity for every decode, so that they share compiled graphs."""
    decode = dict(max_new_tokens=max_new_tokens, temperature=temperature, eos_token_ids=eos, seed=cfg.seed)
    if not resolve_compile(cfg.compile, models.target.device):
        return decode | {"static": False, "compile": False}
    slots = cfg.max_prompt_tokens + cfg.max_new_tokens + max(_widest_gammas(cfg, models), default=0) + 2
    return decode | {"static": True, "compile": True, "capacity": static_capacity(slots)}


def _fixed_gamma(cfg: EvalConfig, drafter: Any) -> int:
    """The gamma `drafter` decodes at where one gamma is asked for (auto: the drafter's own)."""
    return cfg.gamma if isinstance(cfg.gamma, int) else drafter_gamma(drafter)


def _widest_gammas(cfg: EvalConfig, models: _Models) -> list[int]:
    """The most drafts a step takes, per drafter (auto: the step-cost table's widest) and sweep gamma."""
    widest = [COST_MAX_GAMMA if cfg.gamma == AUTO else _fixed_gamma(cfg, d) for d in models.drafters.values()]
    return widest + list(cfg.sweep_gammas)


def _generators(
    models: _Models, gamma: int | str | None, decode: dict, lookup: PromptLookup, batch_sizes: Sequence[int]
) -> dict[str, Generate]:
    """One decode function per method name at `gamma`; compiled, each `filled` to `batch_sizes` and `settled`."""
    generators: dict[str, Generate] = {"autoregressive": partial(autoregressive_generate, models.target, **decode)}
    params = SamplingParams(decode.get("temperature", 0.0))
    for name, drafter in models.drafters.items():
        own = adaptive_gamma(models.target, drafter, params) if gamma == AUTO else gamma
        generators[name] = partial(
            speculative_generate, models.target, drafter, gamma=own, prompt_lookup=lookup, **decode
        )
    if decode.get("compile"):
        generators = {
            name: settled(
                filled(generate, batch_sizes, decode["max_new_tokens"]), name, models.compile_seconds, tqdm.write
            )
            for name, generate in generators.items()
        }
    return generators


def _route(models: _Models, gamma: int | str | None, decode: dict, lookup: PromptLookup) -> Route | None:
    """Decode a batch in one, prompt i with its choice's drafter; None for a static decoder."""
    if decode.get("static"):
        return None

    def route(prompts: list[list[int]], choices: list[str]) -> GenerationResult:
        assign = [None if choice == "autoregressive" else choice for choice in choices]
        drafters = {name: models.drafters[name] for name in assign if name is not None}
        if not drafters:
            return autoregressive_generate(models.target, prompts, **decode)
        return speculative_generate(
            models.target, drafters, prompts, assign=assign, gamma=gamma, prompt_lookup=lookup, **decode
        )

    return route


def _batch_shapes(cfg: EvalConfig, ids: list[list[int]]) -> list[int]:
    """The batch sizes a compiled evaluation of `ids` decodes at, none past the prompts' count."""
    return sorted({min(size, len(ids)) for size in cfg.batch_sizes})


def _run_turns(
    generators: dict[str, Generate],
    methods: list[str],
    ids: list[list[int]],
    batch_size: int,
    chosen: dict[str, list[str]],
    routing_s: float | None,
    route: Route | None,
    rounds: int = 1,
) -> dict[str, RunRecord]:
    """`methods` on every prompt and the `chosen` methods on theirs, taking turns batch by batch
    `rounds` times (`median_rounds`); the routed records pay the router's seconds."""
    records = median_rounds(
        [
            run_interleaved(
                {name: generators[name] for name in methods},
                ids,
                batch_size,
                chosen=chosen,
                pool=generators,
                route=route,
                grouped={"routed_grouped"},
                first=round_,
            )
            for round_ in range(rounds)
        ],
        baseline="autoregressive",
    )
    for name in _ROUTED & set(records):
        records[name].extra_seconds = (routing_s or 0.0) * len(ids)
    return records


def _eval_domain(
    cfg: EvalConfig, models: _Models, domain: str, texts: list[str], ids: list[list[int]], batch1: int, progress: Any
) -> tuple[dict[tuple, dict], float | None]:
    """Counts of every method and setting on one domain's prompts (this process's share), keyed as
    `finalize_rows` expects, and the router's seconds per prompt (None without a router)."""
    local: dict[tuple, dict] = {}
    route_choices: list[str] | None = None
    routing_s: float | None = None
    if models.router is not None:
        start = time.perf_counter()
        route_choices = [_router_key(c) for c in models.router.choose(texts)]
        routing_s = (time.perf_counter() - start) / max(len(texts), 1)
    sweep_batch = min(cfg.batch_sizes)
    for temperature in cfg.temperatures:
        decode = _decode(cfg, models, temperature, cfg.max_new_tokens, models.eos)
        generators = _generators(models, cfg.gamma, decode, cfg.prompt_lookup, _batch_shapes(cfg, ids))
        route = _route(models, cfg.gamma, decode, cfg.prompt_lookup)
        oracle_choices: list[str] | None = None
        sweep_reference: list[list[int]] | None = None
        for batch_size in sorted(cfg.batch_sizes):
            progress.set_postfix_str(f"{domain} T={temperature} B={batch_size}")
            rows = ids if batch_size > 1 else ids[:batch1]
            if not rows:  # a kind of a mixed domain with none of the domain's batch-1 prompts
                progress.update(1)
                continue
            routes = None if route_choices is None else route_choices[: len(rows)]
            # The oracle's rows past batch 1 only where its batch-1 choices cover these prompts.
            routed = [m for m in ("routed", "routed_grouped") if m in cfg.methods and (m == "routed" or batch_size > 1)]
            chosen = {m: routes for m in routed} if routes is not None else {}
            if oracle_choices is not None and len(oracle_choices) == len(rows):
                chosen["oracle"] = oracle_choices
            methods = [name for name in generators if _family(name) in cfg.methods]
            rounds = cfg.batched_rounds if batch_size > 1 else 1
            records = _run_turns(generators, methods, rows, batch_size, chosen, routing_s, route, rounds)
            if "oracle" in cfg.methods and models.candidates and oracle_choices is None:
                oracle_choices = _with_oracle(cfg, models, generators, records, rows, routes, routing_s)
            reference = records["autoregressive"].sequences if temperature == 0.0 else None
            if batch_size == sweep_batch:
                sweep_reference = reference
            for name, record in records.items():
                local[(domain, name, temperature, batch_size, 0 if name == "autoregressive" else cfg.gamma)] = (
                    record.counts(reference)
                )
            progress.update(1)
        if temperature in cfg.sweep_temperatures:
            sweep_ids = ids if sweep_batch > 1 else ids[:batch1]
            sweep_routes = None if route_choices is None else route_choices[: len(sweep_ids)]
            local |= _sweep(
                cfg, models, domain, decode, sweep_ids, sweep_batch, sweep_reference, sweep_routes, routing_s, progress
            )
    return local, routing_s


def _with_oracle(
    cfg: EvalConfig,
    models: _Models,
    generators: dict[str, Generate],
    records: dict[str, RunRecord],
    rows: list[list[int]],
    routes: list[str] | None,
    routing_s: float | None,
) -> list[str]:
    """At batch 1 (EvalConfig requires it): `records` gains the oracle's row, picked per prompt from every
    candidate's batch-1 run, and with `routes` the router's choices scored on those runs; the oracle's choices."""
    pool = {n: records[n] if n in records else run_batched(generators[n], rows, 1) for n in models.candidates}
    if models.pass_costs is None:  # once, after the longest prompt: a machine property
        models.pass_costs = measure_pass_costs(
            models.target,
            {n: models.drafters[n] for n in models.candidates},
            {n: _fixed_gamma(cfg, models.drafters[n]) for n in models.candidates},
            max(rows, key=len),
        )
    choices = pick_per_prompt(pool, models.pass_costs)
    records["oracle"] = composed(pool, choices)
    if routes is not None:
        # Every batch-1 run counts: a router may route to `undistilled`, no oracle candidate.
        runs = pool | {n: r for n, r in records.items() if n in generators}
        records[ROUTED_CHOICES] = composed(runs, routes, (routing_s or 0.0) * len(rows))
    return choices


def _sweep(
    cfg: EvalConfig,
    models: _Models,
    domain: str,
    decode: dict,
    ids: list[list[int]],
    batch_size: int,
    reference: list[list[int]] | None,
    route_choices: list[str] | None,
    routing_s: float | None,
    progress: Any,
) -> dict[tuple, dict]:
    """The gamma sweep: `sweep_methods` at each of `sweep_gammas` but the main one."""
    if not ids:  # a kind of a mixed domain with none of the domain's batch-1 prompts
        progress.update(1)
        return {}
    local: dict[tuple, dict] = {}
    temperature = decode["temperature"]
    for gamma in cfg.sweep_gammas:
        if gamma == cfg.gamma:
            continue
        progress.set_postfix_str(f"{domain} T={temperature} B={batch_size} gamma={gamma}")
        generators = _generators(models, gamma, decode, cfg.prompt_lookup, _batch_shapes(cfg, ids))
        methods = [m for m in cfg.sweep_methods if m in generators and _family(m) in cfg.methods]
        routed = "routed" in cfg.sweep_methods and "routed" in cfg.methods and route_choices is not None
        chosen = {"routed": route_choices} if routed and route_choices is not None else {}
        if not methods and not chosen:
            continue
        route = _route(models, gamma, decode, cfg.prompt_lookup)
        for method, record in _run_turns(generators, methods, ids, batch_size, chosen, routing_s, route).items():
            local[(domain, method, temperature, batch_size, gamma)] = record.counts(reference)
    progress.update(1)
    return local


@locks_output_dir
def run_eval(cfg: EvalConfig, router_loader: Callable[[str], object] | None = None) -> dict:
    """Evaluate every method on every domain and setting; write results.json and report.md. Under
    `accelerate launch` each process decodes its share of the prompts."""
    check_tracker_installed(cfg)
    require_heldout(cfg.data, cfg.prompts_per_domain, "prompts_per_domain")  # before any model loads
    check_heldout_prompts(cfg, load_tokenizer(cfg.target))
    accelerator, device = placed_accelerator(cfg.device, log_with=cfg.log_with)
    start_tracking(accelerator, cfg, asdict(cfg), Path(cfg.output_dir))
    models = _load_models(cfg, device, router_loader)
    shares = []
    for domain in cfg.domains:
        prompts = heldout_prompts(models.tokenizer, cfg.data[domain], cfg.prompts_per_domain, cfg.max_prompt_tokens)
        shares += kind_shares(cfg.data[domain], prompts, cfg.batch1_prompts or len(prompts))
    steps = len(shares) * (
        len(cfg.temperatures) * len(cfg.batch_sizes) + len([t for t in cfg.temperatures if t in cfg.sweep_temperatures])
    )
    progress = tqdm(total=steps, desc="eval", disable=not accelerator.is_main_process)
    local: dict[tuple, dict] = {}
    routing_seconds: dict[str, float] = {}
    warmed = False
    for domain, prompts, batch1_limit in shares:
        with accelerator.split_between_processes(list(enumerate(prompts))) as mine:
            if mine and not warmed:
                _warm_up(cfg, models, mine[0][1][1])
                warmed = True
            # each process's share is contiguous: its batch-1 prompts are a prefix of it
            batch1 = sum(1 for i, _ in mine if i < batch1_limit)
            texts, ids = [t for _, (t, _) in mine], [p for _, (_, p) in mine]
            counts, routing_s = _eval_domain(cfg, models, domain, texts, ids, batch1, progress)
            if cfg.token_pages and accelerator.is_main_process and domain in cfg.domains:
                pages = slice(0, cfg.token_pages)
                write_token_pages(cfg, models, domain, texts[pages], ids[pages], _router_key)
        local |= counts
        if routing_s is not None:
            routing_seconds[domain] = routing_s
    progress.close()
    results = _publish(cfg, accelerator, models, local, routing_seconds)
    if accelerator.trackers:
        accelerator.end_training()  # finishes the wandb run
    return results


def _warm_up(cfg: EvalConfig, models: _Models, prompt: list[int]) -> None:
    """Every method decodes `prompt` once at batch 1, untimed: first decodes pay one-off costs."""
    tokens = warm_up_tokens(cfg.max_new_tokens, _widest_gammas(cfg, models))
    decode = _decode(cfg, models, cfg.temperatures[0], tokens, eos=[])
    for generate in _generators(models, cfg.gamma, decode, cfg.prompt_lookup, cfg.batch_sizes).values():
        generate([prompt])


def _publish(
    cfg: EvalConfig, accelerator: Any, models: _Models, local: dict[tuple, dict], routing_seconds: dict[str, float]
) -> dict:
    """Gather every process's counts; the main process writes results.json and report.md."""
    gathered = accelerator.gather_for_metrics([local], use_gather_object=True)
    results: dict = {}
    if accelerator.is_main_process:
        merged = {key: merge_counts([part[key] for part in gathered]) for key in gathered[0]}
        # no sweep rows, no kind's rows
        main = {key: counts for key, counts in merged.items() if key[4] in (0, cfg.gamma) and key[0] in cfg.domains}
        results = {
            "config": asdict(cfg),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "processes": accelerator.num_processes,
            "routing_seconds_per_prompt": routing_seconds,
            "cpu_kernels": {"target": kernel_picks(models.target)}
            | {name: kernel_picks(d) for name, d in models.drafters.items()},
            "rows": [row | {"max_new_tokens": cfg.max_new_tokens} for row in finalize_rows(merged)],
            "compile_seconds": models.compile_seconds,
            "router_share": router_share(
                finalize_rows(main), [_method_name(n) for n in cfg.drafters if n != "alldata"]
            ),
        }
        out = Path(cfg.output_dir)
        write_atomic(out / "results.json", json.dumps(results, indent=2))
        write_report(results, out)
        if cfg.logger == "wandb":
            log_results(accelerator, results, out)
    accelerator.wait_for_everyone()
    return results


def _router_key(drafter_name: str) -> str:
    """Router drafter names are `generic` or a domain; evaluation methods name them as rows do."""
    if drafter_name == NO_DRAFTER:
        return "autoregressive"
    return drafter_name if drafter_name == "undistilled" else _method_name(drafter_name)
