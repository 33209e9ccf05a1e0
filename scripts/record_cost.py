"""What the per-token record costs: the same decodes with `record` off and on, interleaved, medians.

    python scripts/record_cost.py                                 # the smoke target, 128 new tokens
    python scripts/record_cost.py --target smollm2-135m-instruct --repeats 3   # the embedded target
    python scripts/record_cost.py --baseline-rev <commit>         # also the loop as it was at <commit>

Each prompt (batch 1, no EOS, so every decode runs its whole budget) is decoded once per mode per
repeat, the modes taking turns in a rotating order; the cost is the median over (repeat, prompt)
of the ratio mode / off, in wall and in CPU seconds (CPU time is less disturbed by other processes
on a shared machine). The recorder's own methods are also timed in the `on` decodes: an upper
bound of what recording adds, free of the machine's noise. `--baseline-rev` loads
decoding/decode.py as it was at that commit (the loop before the record) beside today's modules,
to show what `record=False` costs against it.
"""

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdecode import speculative_generate
from specdecode.decoding.record import Recorder
from specdecode.models import derive_drafter, load_model

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--target", default="smoke", help="a load_model name: smoke, smollm2-135m-instruct, a folder")
parser.add_argument("--drafter-layers", type=int, default=1, help="layers of the drafter derived from the target")
parser.add_argument("--new-tokens", type=int, default=128)
parser.add_argument("--prompts", type=int, default=4)
parser.add_argument("--gamma", type=int, default=4)
parser.add_argument("--repeats", type=int, default=7)
parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
parser.add_argument("--device", default="cpu")
parser.add_argument("--baseline-rev", default=None, help="a commit whose decoding/decode.py to time as 'baseline'")
args = parser.parse_args()

torch.set_num_threads(args.threads)
target, tokenizer = load_model(args.target, device=args.device)
drafter = derive_drafter(target, args.drafter_layers)
texts = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h?",
    "What are three good habits for getting better sleep?",
    "Explain what a hash table is, then give an example in Python.",
]
prompts = [tokenizer(texts[i % len(texts)])["input_ids"] for i in range(args.prompts)]
kwargs = dict(max_new_tokens=args.new_tokens, gamma=args.gamma, eos_token_ids=[])


def baseline_generate(rev: str):
    """`speculative_generate` of decoding/decode.py at `rev`, importing today's other modules."""
    source = subprocess.run(
        ["git", "show", f"{rev}:specdecode/decoding/decode.py"], capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "decode_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("decode_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["decode_baseline"] = module
    spec.loader.exec_module(module)
    return module.speculative_generate


modes = {
    "off": lambda p: speculative_generate(target, drafter, [p], **kwargs),
    "on": lambda p: speculative_generate(target, drafter, [p], record=True, **kwargs),
}
if args.baseline_rev:
    old = baseline_generate(args.baseline_rev)
    modes = {"baseline": lambda p: old(target, drafter, [p], **kwargs)} | modes

# The recorder's own seconds in the "on" decodes: every call of its methods, timed (an upper bound
# of what recording adds, free of the machine's noise; the timers' own overhead is included).
own = {"seconds": 0.0}


def timed(method):
    def wrapper(*a, **kw):
        start = time.perf_counter()
        try:
            return method(*a, **kw)
        finally:
            own["seconds"] += time.perf_counter() - start

    return wrapper


for name in ("add", "synced", "rows"):
    setattr(Recorder, name, timed(getattr(Recorder, name)))

for run in modes.values():  # untimed: the first passes pay one-off costs
    run(prompts[0])

names = list(modes)
wall = {name: [] for name in names}
cpu = {name: [] for name in names}
tokens = steps = 0
own["seconds"] = 0.0
for r in range(args.repeats):
    for k, p in enumerate(prompts):
        turn = r * len(prompts) + k
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            start, start_cpu = time.perf_counter(), time.process_time()
            result = modes[name](p)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
            if name == "on":
                tokens, steps = tokens + result.stats.generated_tokens, steps + result.stats.target_calls

print(
    f"target {args.target} · drafter: {args.drafter_layers} derived layer(s) · gamma {args.gamma} · "
    f"{len(prompts)} prompts × {args.new_tokens} new tokens at batch 1, {args.repeats} repeats "
    f"({tokens} tokens, {steps} target passes recorded) · {args.threads} thread(s) · torch {torch.__version__}"
)
print("| mode | median s per decode (wall) | median s (CPU) | vs off, wall (median of pairs) | vs off, CPU |")
print("|---|---|---|---|---|")
for name in names:
    paired = [statistics.median(a / b for a, b in zip(t[name], t["off"])) for t in (wall, cpu)]
    print(
        f"| {name} | {statistics.median(wall[name]):.4f} | {statistics.median(cpu[name]):.4f} | "
        f"{100 * (paired[0] - 1):+.2f}% | {100 * (paired[1] - 1):+.2f}% |"
    )
print(
    f"recorder's own time (add, synced, rows) in the 'on' decodes: {1000 * own['seconds']:.1f} ms of "
    f"{sum(wall['on']):.2f} s = {100 * own['seconds'] / sum(wall['on']):.3f}% "
    f"({1e6 * own['seconds'] / max(steps, 1):.1f} µs per target pass)"
)
