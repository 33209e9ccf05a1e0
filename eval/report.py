"""Merge a gamma multirun of eval/acceptance.py into one report: `python eval/report.py multirun_dir=...`."""

import sys

from specdecode.pipeline.cli import report

if __name__ == "__main__":
    report(sys.argv[1:])
