"""Plot realised alpha against the target-written sequences a drafter trained on (the scaling curve).

    python scripts/plot_curve.py --runs outputs/curve --out docs/images/scaling-curve.png

Reads `<runs>/eval-<domain>-<sequences>/results.json` (eval/acceptance.py with the trained drafter as
`generic`, as the curve's record runs it) for every domain and size found, and draws one line per
domain on a log-2 axis of sequences.
"""

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=Path("outputs/curve"))
    parser.add_argument("--out", type=Path, default=Path("docs/images/scaling-curve.png"))
    args = parser.parse_args()
    curves: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for results in sorted(args.runs.glob("eval-*-*/results.json")):
        found = re.fullmatch(r"eval-(.+)-(\d+)", results.parent.name)
        alpha = next((r["alpha"] for r in json.loads(results.read_text())["rows"] if r["method"] == "generic"), None)
        if found and alpha is not None:
            curves[found[1]].append((int(found[2]), alpha))
    if not curves:
        raise SystemExit(f"no eval-<domain>-<sequences>/results.json with a generic row under {args.runs}")
    figure, axis = plt.subplots(figsize=(5.5, 3.5))
    for domain, points in sorted(curves.items()):
        counts, alphas = zip(*sorted(points))
        axis.plot(counts, alphas, marker="o", label=domain)
        print(domain, ", ".join(f"{n}: {a:.3f}" for n, a in zip(counts, alphas)))
    axis.set_xscale("log", base=2)
    sizes = sorted({n for points in curves.values() for n, _ in points})
    axis.set_xticks(sizes, [str(n) for n in sizes])
    axis.minorticks_off()
    axis.set_xlabel("target-written training sequences (4 epochs)")
    axis.set_ylabel("realised alpha, 128 new tokens")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
