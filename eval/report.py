"""Merge a gamma multirun of eval/acceptance.py into one report: `python eval/report.py multirun_dir=...`."""

import json
import sys
from pathlib import Path

from specdecode.core.atomic import write_atomic
from specdecode.evaluation.report import merge_results, write_report


def main(multirun_dir: str) -> None:
    root = Path(multirun_dir)
    results = merge_results(root.glob("*/results.json"))
    write_atomic(root / "results.json", json.dumps(results, indent=2))
    print(write_report(results, root))


if __name__ == "__main__":
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    if set(args) != {"multirun_dir"}:
        sys.exit("usage: python eval/report.py multirun_dir=<folder holding */results.json>")
    main(args["multirun_dir"])
