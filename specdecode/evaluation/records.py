"""What an evaluation counts (`RunRecord`), how processes' counts merge into results.json rows, the
batching policies the methods decode with, and compiled decodes timed apart from their compiling."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from functools import partial

from specdecode.decoding.compiled import graphs_compiled
from specdecode.decoding.stats import GenerationResult

Generate = Callable[[list[list[int]]], GenerationResult]
# `route(prompts, choices=...)`: one batch, prompt i drafting with the drafter `choices[i]` names.
Route = Callable[..., GenerationResult]

# The router's choices scored on the drafters' own batch-1 runs, as the oracle's row is (`composed`).
ROUTED_CHOICES = "routed_choices"


@dataclass
class RunRecord:
    """One method's decode of one prompt set: its batches' results, and each prompt's position among
    the batches' concatenated sequences (None: in order)."""

    results: list[GenerationResult]
    order: list[int] | None = None
    # Work outside decoding that the method pays for (the router's embedding and MLP).
    extra_seconds: float = 0.0
    # Decode seconds are multiplied by this: a round's, carried to the baseline's median round (`median_rounds`).
    time_scale: float = 1.0

    @property
    def sequences(self) -> list[list[int]]:
        flat = [s for r in self.results for s in r.sequences]
        return flat if self.order is None else [flat[i] for i in self.order]

    @property
    def tokens(self) -> int:
        return sum(r.stats.generated_tokens for r in self.results)

    @property
    def seconds(self) -> float:
        return sum(r.stats.wall_time_s for r in self.results) * self.time_scale + self.extra_seconds

    def counts(self, reference: list[list[int]] | None) -> dict:
        """Raw, summable counts (what processes gather before rows are computed)."""
        gamma = max(r.stats.gamma for r in self.results)
        reached, passed = [0] * gamma, [0] * gamma
        for r in self.results:
            histogram = r.stats.accepted_length_histogram
            for i in range(r.stats.gamma):
                reached[i] += r.stats.judged[i] if r.stats.judged else sum(histogram[i:])
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


def rates(counts: dict) -> dict[str, float | None]:
    """alpha and tau of summed `counts` (as `DecodeStats` defines them); None where nothing was judged or called."""
    judged = counts["accepted"] + counts["rejections"]
    return {
        "alpha": counts["accepted"] / judged if judged else None,
        "tau": counts["tokens"] / counts["row_calls"] if counts["row_calls"] else None,
    }


def merge_counts(parts: list[dict]) -> dict:
    """Counts of one (domain, method, setting) from several concurrent processes: wall time is the slowest's."""
    merged = dict(parts[0])
    for part in parts[1:]:
        for key in ("tokens", "accepted", "rejections", "row_calls", "prompts"):
            merged[key] += part[key]
        merged["seconds"] = max(merged["seconds"], part["seconds"])
        merged["reached"] = [a + b for a, b in zip(merged["reached"], part["reached"])]
        merged["passed"] = [a + b for a, b in zip(merged["passed"], part["passed"])]
        merged["matches"] = None if merged["matches"] is None else merged["matches"] + part["matches"]
    return merged


# One call of a method: the decode function and the prompts (indices) it decodes together.
Batch = tuple[Generate, list[int]]


def consecutive_batches(generate: Generate, count: int, batch_size: int) -> list[Batch]:
    """`count` prompts in consecutive batches of `batch_size`, all decoded by `generate`."""
    return [(generate, list(range(start, min(start + batch_size, count)))) for start in range(0, count, batch_size)]


def grouped_batches(generators: dict[str, Generate], choices: list[str], batch_size: int) -> list[Batch]:
    """Each prompt decoded by its choice's generator, prompts of one choice batched together."""
    by_choice: dict[str, list[int]] = {}
    for i, choice in enumerate(choices):
        by_choice.setdefault(choice, []).append(i)
    batches = [
        (generators[choice], members[start : start + batch_size])
        for choice, members in by_choice.items()
        for start in range(0, len(members), batch_size)
    ]
    return sorted(batches, key=lambda batch: batch[1][0])


def run_interleaved(
    generators: dict[str, Generate],
    prompts: list[list[int]],
    batch_size: int,
    chosen: dict[str, list[str]] | None = None,
    pool: dict[str, Generate] | None = None,
    route: Route | None = None,
    grouped: Collection[str] = (),
    first: int = 0,
) -> dict[str, RunRecord]:
    """Decode `prompts` with every method, the methods taking turns batch by batch (a machine whose
    speed drifts slows every method alike); turn k starts at the (`first` + k)-th method.
    `chosen` names methods that decode prompt i with `pool[chosen[method][i]]`: past batch 1 in mixed
    batches through `route` where given, else (and for `grouped`) as `grouped_batches` groups them.
    """
    plans = {name: consecutive_batches(fn, len(prompts), batch_size) for name, fn in generators.items()}
    for name, choices in (chosen or {}).items():
        if len(choices) != len(prompts):
            raise ValueError(f"{name}: {len(choices)} choices for {len(prompts)} prompts")
        missing = sorted(set(choices) - set(pool or {}))
        if missing:
            raise ValueError(f"{name} chooses {missing}, which the pool of generators lacks")
        if route is not None and batch_size > 1 and name not in grouped:  # each batch decoded in one by `route`
            plans[name] = [
                (partial(route, choices=[choices[i] for i in members]), members)
                for _, members in consecutive_batches(route, len(choices), batch_size)
            ]
        else:
            plans[name] = grouped_batches(pool or {}, choices, batch_size)
    results: dict[str, list[GenerationResult]] = {name: [] for name in plans}
    names = list(plans)
    for turn in range(max((len(plan) for plan in plans.values()), default=0)):
        start = (first + turn) % len(names)
        for name in names[start:] + names[:start]:
            if turn < len(plans[name]):
                generate, members = plans[name][turn]
                results[name].append(generate([prompts[i] for i in members]))
    records = {}
    for name, plan in plans.items():
        flat = [i for _, members in plan for i in members]
        position = {prompt: k for k, prompt in enumerate(flat)}
        order = None if flat == list(range(len(prompts))) else [position[i] for i in range(len(prompts))]
        records[name] = RunRecord(results[name], order=order)
    return records


def median_rounds(rounds: Sequence[dict[str, RunRecord]], baseline: str | None = None) -> dict[str, RunRecord]:
    """Each method's record from the round in which it took the median seconds (the lower of the
    middle two); with `baseline`, each other method's round of the median speedup over the baseline,
    its seconds carried to the baseline's median round, so drift between rounds cancels."""
    middle = (len(rounds) - 1) // 2
    kept = {name: sorted((r[name] for r in rounds), key=lambda record: record.seconds)[middle] for name in rounds[0]}
    if baseline is None or baseline not in kept:
        return kept
    for name in kept.keys() - {baseline}:
        paired = sorted(rounds, key=lambda r: r[baseline].seconds / r[name].seconds)[middle]
        scale = kept[baseline].seconds / paired[baseline].seconds
        kept[name] = replace(paired[name], time_scale=paired[name].time_scale * scale)
    return kept


def run_batched(generate: Generate, prompts: list[list[int]], batch_size: int) -> RunRecord:
    """Decode `prompts` in consecutive batches of `batch_size` with one method."""
    return run_interleaved({"one": generate}, prompts, batch_size)["one"]


def composed(pool: dict[str, RunRecord], choices: list[str], extra_seconds: float = 0.0) -> RunRecord:
    """A chooser's row: prompt i's result from `pool[choices[i]]`'s batch-1 run, plus `extra_seconds`."""
    missing = sorted(set(choices) - set(pool))
    if missing:
        raise ValueError(f"choices name {missing}, which the pool of runs lacks")
    for name in sorted(set(choices)):
        run = pool[name]
        if run.order is not None or len(run.results) != len(choices) or any(len(r.sequences) != 1 for r in run.results):
            raise ValueError(
                f"pool[{name!r}] is no batch-1 run of the {len(choices)} prompts chosen for "
                f"({len(run.results)} batches, order {run.order})"
            )
    return RunRecord([pool[c].results[i] for i, c in enumerate(choices)], extra_seconds=extra_seconds)


def pick_per_prompt(records: dict[str, RunRecord], pass_costs: dict[str, float] | None = None) -> list[str]:
    """The oracle's choice per prompt from batch-1 records: the method with the highest tau over
    `pass_costs[method]` (one pass in target steps; 1 without), ties to the first listed; not the
    measured seconds, which would credit the oracle with its own timing luck."""
    names = list(records)
    missing = sorted(set(names) - set(pass_costs)) if pass_costs is not None else []
    if missing:
        raise ValueError(f"pass_costs lacks {missing}")
    cost = {n: 1.0 if pass_costs is None else pass_costs[n] for n in names}
    count = len(records[names[0]].results)
    return [max(names, key=lambda n: records[n].results[i].stats.tau / cost[n]) for i in range(count)]


def finalize_rows(keyed_counts: dict[tuple, dict]) -> list[dict]:
    """results.json rows from merged counts keyed by (domain, method, temperature, batch_size,
    gamma); a `None` gamma means each drafter ran at its own stored gamma, which the counts carry."""
    rows = []
    for (domain, method, temperature, batch_size, gamma), c in keyed_counts.items():
        base = keyed_counts[(domain, "autoregressive", temperature, batch_size, 0)]
        tokens_per_s = c["tokens"] / c["seconds"] if c["seconds"] else 0.0
        base_tps = base["tokens"] / base["seconds"] if base["seconds"] else 0.0
        rows.append(
            {
                "domain": domain,
                "method": method,
                "gamma": gamma if gamma is not None else c["gamma"],
                "temperature": temperature,
                "batch_size": batch_size,
                **rates(c),
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


def router_share(rows: list[dict], singles: Sequence[str] | None = None) -> list[dict]:
    """The router's share of the oracle's gain, (chooser − best single) / (oracle − best single) on
    the speedups averaged over the domains, per (temperature, batch size), for `routed` and
    `routed_choices`. `singles`: the drafters chosen between (None: every `generic` /
    `specialized:*` method). A share is None where the oracle is not above the best single."""
    shares = []
    for temperature, batch_size in dict.fromkeys((r["temperature"], r["batch_size"]) for r in rows):
        here = [r for r in rows if (r["temperature"], r["batch_size"]) == (temperature, batch_size)]
        domains = {r["domain"] for r in here}
        speedups: dict[str, list[float]] = {}
        for r in here:
            if r["speedup"] is not None:
                speedups.setdefault(r["method"], []).append(r["speedup"])
        mean = {m: sum(v) / len(v) for m, v in speedups.items() if len(v) == len(domains)}
        trained = [m for m in mean if m == "generic" or m.startswith("specialized:")]
        candidates = trained if singles is None else list(singles)
        if "oracle" not in mean or not candidates or any(m not in mean for m in candidates):
            continue
        if not any(chooser in mean for chooser in ("routed", ROUTED_CHOICES)):
            continue
        best = max(candidates, key=lambda m: mean[m])
        gain = mean["oracle"] - mean[best]
        entry: dict = {
            "temperature": temperature,
            "batch_size": batch_size,
            "best_single": best,
            "best_single_speedup": mean[best],
            "oracle_speedup": mean["oracle"],
        }
        for chooser in ("routed", ROUTED_CHOICES):
            if chooser in mean:
                entry[f"{chooser}_speedup"] = mean[chooser]
                entry[f"{chooser}_share"] = (mean[chooser] - mean[best]) / gain if gain > 0 else None
        shares.append(entry)
    return shares


def settled(
    generate: Generate,
    name: str,
    compile_seconds: dict[str, float],
    on_compile: Callable[[str], None] = lambda line: None,
) -> Generate:
    """`generate`, except that a call which compiled a graph decodes again and returns the second
    decode; the first's excess time goes to `compile_seconds[name]` and a line to `on_compile`."""

    def run(prompts: list[list[int]]) -> GenerationResult:
        before = graphs_compiled()
        first = generate(prompts)
        if graphs_compiled() == before:
            return first
        compiled = graphs_compiled()
        again = generate(prompts)
        if graphs_compiled() != compiled:
            warnings.warn(f"{name}: a decode compiled again when repeated; its timed run includes compiling")
        excess = max(first.stats.wall_time_s - again.stats.wall_time_s, 0.0)
        compile_seconds[name] = compile_seconds.get(name, 0.0) + excess
        on_compile(f"{name}: compiled a decode of {len(prompts)} prompts in {excess:.1f} s (kept out of its timing)")
        return again

    return run


def filled(generate: Callable[..., GenerationResult], batch_sizes: Sequence[int], budget: int) -> Generate:
    """`generate`, except that a batch is filled up to the smallest of `batch_sizes` that holds it
    with one-token rows of no budget (compiled, each batch size is a graph of its own)."""

    def run(prompts: list[list[int]]) -> GenerationResult:
        size = min((b for b in batch_sizes if b >= len(prompts)), default=len(prompts))
        fill = size - len(prompts) if prompts else 0
        if fill == 0:
            return generate(prompts)
        result = generate(prompts + [prompts[0][:1]] * fill, max_new_tokens=[budget] * len(prompts) + [0] * fill)
        stats = result.stats
        row_calls = round(stats.generated_tokens / stats.tau) - fill if stats.tau else 0
        tau = stats.generated_tokens / row_calls if row_calls > 0 else 0.0
        return replace(
            result,
            sequences=result.sequences[: len(prompts)],
            stats=replace(stats, tau=tau),
            features=None if result.features is None else result.features[: len(prompts)],
            record=None if result.record is None else result.record[: len(prompts)],
        )

    return run
