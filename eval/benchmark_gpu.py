"""The decode benchmark's cores side by side (`make benchmark-gpu`, `run_core_benchmark`): eager,
static and compiled; target alone, ours and transformers assisted; fp32 and bf16; the data writer
at batch 256.

Defaults: SmolLM2-135M, batch 1, 128-token answers, the methods of `DEFAULT_METHODS`, fp32 and bf16.
Each compiled method's first call took 64–86 s in bf16 on an H200. `--nested-layers` compiles
one decoder layer for all of them, which made the first call 37–44% shorter on the CPU (exact
with torch 2.11, 2.13 and 2.14; not yet run on a GPU). One dtype is
about one 10-minute call: `--dtypes bfloat16`, and `--time-limit-s` to stop starting methods in
time (docs/gpu-runs.md). `--every-method`, `--batch-sizes 1 8` and `--targets ...
llama-3.2-1b-shape` widen it. `--step-costs` first prints each drafter's step costs per core: a
drafter step over a target step (c) and a verify over a step, the figures the speedup model reads.

    python eval/benchmark_gpu.py --drafter DIR                # SmolLM2-135M on CUDA, with a trained feature drafter
    python eval/benchmark_gpu.py --device cpu --tiny          # a tiny random model: checks it runs, in minutes
"""

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

import specdecode.decoding.compiled
from specdecode.evaluation.benchmark import run_core_benchmark
from specdecode.evaluation.benchmark_methods import DEFAULT_METHODS
from specdecode.evaluation.benchmark_report import benchmark_results, report_markdown
from specdecode.evaluation.benchmark_targets import TARGETS

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--device", default="cuda")
parser.add_argument("--targets", nargs="+", default=list(TARGETS[:1]), choices=TARGETS)
parser.add_argument("--tiny", action="store_true", help="a tiny random target, small batches and few tokens")
parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1])
parser.add_argument("--gamma", type=int, default=4)
parser.add_argument("--new-tokens", type=int, default=128)
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--writer-batch", type=int, default=256, help="0: skip the data writer")
parser.add_argument("--prompts-at-batch-1", type=int, default=2)
parser.add_argument(
    "--only",
    nargs="*",
    default=list(DEFAULT_METHODS),
    help="time only the methods whose names contain one of these (default: DEFAULT_METHODS)",
)
parser.add_argument("--every-method", action="store_true", help="every method on every core (overrides --only)")
parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
parser.add_argument("--drafter", default=None, help="a saved feature drafter of the (first) target")
parser.add_argument("--profile", action="store_true", help="print where each method's time goes (one more call)")
parser.add_argument(
    "--time-limit-s",
    type=float,
    default=None,
    help="after this many seconds start no method or profile, and no round after the first",
)
parser.add_argument(
    "--nested-layers",
    action="store_true",
    help="compile one decoder layer for all (a nested region: a shorter first compile)",
)
parser.add_argument(
    "--step-costs",
    action="store_true",
    help="first time each drafter's step costs (c, the verify ratio) on each core, at batch 1: three more "
    "compiled graphs per drafter, started before --time-limit-s but not stopped by it",
)
parser.add_argument("--out", default=None, help="also write the rows as JSON here")
args = parser.parse_args()

specdecode.decoding.compiled.NESTED_LAYERS = args.nested_layers

if args.threads:
    torch.set_num_threads(args.threads)
targets = ["tiny"] if args.tiny else args.targets
rows = []
for target in targets:
    rows += run_core_benchmark(
        target,
        args.device,
        args.dtypes,
        args.batch_sizes,
        args.gamma,
        16 if args.tiny else args.new_tokens,
        args.prompts_at_batch_1,
        args.rounds,
        writer_batch=min(args.writer_batch, 32) if args.tiny else args.writer_batch,
        writer_tokens=16 if args.tiny else 64,
        drafter=args.drafter if target == targets[0] else None,
        only=[] if args.every_method else args.only,
        profile=args.profile,
        time_limit_s=args.time_limit_s,
        step_costs=args.step_costs,
    )
print(report_markdown(benchmark_results(rows, args.device)))
if args.out:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps([asdict(r) for r in rows], indent=2))
