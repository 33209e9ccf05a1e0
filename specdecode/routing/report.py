"""How well a router routes on labelled rows (`routing_report`), and the report's markdown."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from specdecode.routing.router import OBJECTIVE, Router, label_matrix


def routing_report(router: Router, rows: Sequence[Mapping[str, Any]], *, latency_repeats: int = 5) -> dict[str, Any]:
    """Routed vs oracle vs best single drafter (in hindsight) vs random (its expectation) on the
    labels of the drafter each picks, `gain_recovered` = (routed − best single) / (oracle − best
    single) per metric; the share of rows whose domain the router names, domain × drafter
    confusion tables and routing latency.
    """
    texts = [r["prompt"] for r in rows]
    drafters = router.drafters
    router.route(texts[: min(len(texts), 8)])
    timings = []
    for _ in range(latency_repeats):
        start = time.perf_counter()
        choices = router.route(texts)
        timings.append(time.perf_counter() - start)
    # one prompt at a time too, as a server routes each request
    single = []
    for text in texts[:16]:
        start = time.perf_counter()
        router.route([text])
        single.append(time.perf_counter() - start)
    chosen = torch.tensor(choices)
    policies: dict[str, dict[str, float]] = {name: {} for name in ("routed", "oracle", "best single", "random")}
    gain: dict[str, float | None] = {}
    # the decoded speedup where the labels have it (greedy), beside the teacher-forced figures
    metrics = ("acceptance", "greedy_match", "speedup") + (
        ("decode_speedup",) if all("decode_speedup" in r for r in rows) else ()
    )
    for metric in metrics:
        values = label_matrix(rows, metric, drafters)  # [N, K]
        means = values.mean(0)
        best = int(means.argmax())
        routed, best_mean = values.gather(1, chosen.unsqueeze(1)).mean().item(), means[best].item()
        policies["routed"][metric] = routed
        policies["oracle"][metric] = values.max(1).values.mean().item()
        policies["best single"][metric] = best_mean
        policies["random"][metric] = values.mean().item()
        policies["best single"][f"{metric}_drafter"] = drafters[best]  # type: ignore[assignment]  # the row mixes figures and the drafter's name
        headroom = policies["oracle"][metric] - best_mean
        gain[metric] = (routed - best_mean) / headroom if headroom > 1e-12 else None
    oracle_choice = label_matrix(rows, OBJECTIVE, drafters).argmax(1).tolist()
    named = router.domain_of(texts)
    domains = sorted({r["domain"] for r in rows})
    confusion, oracle_confusion = ({d: dict.fromkeys(drafters, 0) for d in domains} for _ in range(2))
    for row, k, o in zip(rows, choices, oracle_choice):
        confusion[row["domain"]][drafters[k]] += 1
        oracle_confusion[row["domain"]][drafters[o]] += 1
    return {
        "prompts": len(rows),
        "objective": OBJECTIVE,
        "domain_accuracy": sum(n == r["domain"] for n, r in zip(named, rows)) / len(rows),
        "policies": policies,
        "gain_recovered": gain,
        "agreement_with_oracle": sum(k == o for k, o in zip(choices, oracle_choice)) / len(rows),
        "confusion": confusion,
        "oracle_confusion": oracle_confusion,
        # rows beyond every domain's far-prompt threshold, which took the fallback route
        "far_prompts": sum(router.far(texts)),
        "routing_latency_ms_per_prompt": statistics.median(timings) / len(rows) * 1e3,
        "routing_batch": len(rows),
        "routing_latency_ms_batch1": statistics.median(single) * 1e3,
        "torch_threads": torch.get_num_threads(),
    }


def percent(share: float | None) -> str:
    """A share as a whole percentage; a dash where there is none (no gain to share)."""
    return "–" if share is None else f"{100 * share:.0f}%"


def report_markdown(report: dict[str, Any]) -> str:
    """The report as markdown tables (report.md)."""
    policies, gain = report["policies"], report["gain_recovered"]

    decoded = "decode_speedup" in gain
    lines = [
        f"# Router — {report['prompts']} held-out prompts, objective `{report['objective']}`",
        "",
        "| policy | acceptance | greedy match | predicted speedup |" + (" decoded speedup |" if decoded else ""),
        "|---|---|---|---|" + ("---|" if decoded else ""),
    ]
    for name in ("routed", "oracle", "best single", "random"):
        p = policies[name]
        label = name if name != "best single" else f"best single ({p['acceptance_drafter']} / {p['speedup_drafter']})"
        lines.append(
            f"| {label} | {p['acceptance']:.4f} | {p['greedy_match']:.4f} | {p['speedup']:.3f}× |"
            + (f" {p['decode_speedup']:.3f}× |" if decoded else "")
        )
    lines += [
        f"| gain recovered (routed − best single) / (oracle − best single) | {percent(gain['acceptance'])} | "
        f"{percent(gain['greedy_match'])} | {percent(gain['speedup'])} |"
        + (f" {percent(gain['decode_speedup'])} |" if decoded else ""),
        "",
        f"Domain named right: {100 * report['domain_accuracy']:.0f}%. "
        f"Agreement with the oracle's choice: {100 * report['agreement_with_oracle']:.0f}%. Routing latency: "
        f"{report['routing_latency_ms_per_prompt']:.2f} ms per prompt in a batch of {report['routing_batch']}, "
        f"{report['routing_latency_ms_batch1']:.2f} ms one at a time (embedding included, "
        f"{report['torch_threads']} torch threads).",
        "",
    ]
    novelty = report.get("fit", {}).get("novelty")
    if novelty:
        thresholds = ", ".join(f"{d} {t:.3f}" for d, t in novelty["thresholds"].items())
        lines += [
            f"Far prompts: beyond every domain's {novelty['quantile']} quantile of held-out cosine distance to its "
            f"centroid ({thresholds}), a prompt goes to `{novelty['fallback']}`; "
            f"{report.get('far_prompts', 0)} of these {report['prompts']} held-out prompts did.",
            "",
        ]
    for title, table in (("Chosen drafter", report["confusion"]), ("Oracle's drafter", report["oracle_confusion"])):
        drafters = list(next(iter(table.values())))
        lines += [
            f"{title} per domain:",
            "",
            "| domain | " + " | ".join(drafters) + " |",
            "|---" * (len(drafters) + 1) + "|",
        ]
        lines += [f"| {d} | " + " | ".join(str(counts[n]) for n in drafters) + " |" for d, counts in table.items()]
        lines.append("")
    return "\n".join(lines)
