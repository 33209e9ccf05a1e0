"""Routed `gamma="auto"` against the target alone at batch 8, in many short interleaved pairs.

    python scripts/batch_pairs.py math --temperature 0.0 --pairs 6
    python scripts/batch_pairs.py mixed --temperature 0.7 --pairs 6 --one-table --groups
    python scripts/batch_pairs.py code --temperature 0.7 skinny_matmul=null   # the demo's CPU kernels

Decodes one domain's first 8 held-out prompts (128 new tokens) as one batch with the demo's trained
drafters, each prompt routed by the demo's router, and with the target alone; the methods take
turns, the order reversed every other pair. A pair's ratio cancels the machine's drift between
pairs (on a 2-core machine the target alone moved 13-21 s between pairs of one run); the median
over pairs is the figure. `--one-table` adds the adaptive gamma timed with the first drafter only
(a mixed batch then pays one drafter's drafts, not each one's); `--groups` adds the routed prompts
decoded one batch per chosen drafter, and the one batch's speedup over it. After the pairs, one recorded
decode compares each step's measured seconds with what the step table predicted for its batch
size and gamma.
"""

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specdecode.core.paths import CONF_DIR
from specdecode.decoding.adaptive import AdaptiveGamma
from specdecode.decoding.costs import step_table
from specdecode.decoding.decode import (
    adaptive_gamma,
    autoregressive_generate,
    drafter_alpha,
    speculative_generate,
)
from specdecode.decoding.mixed import row_drafters
from specdecode.decoding.sampling import SamplingParams
from specdecode.decoding.stats import GenerationResult
from specdecode.evaluation.suite import heldout_prompts
from specdecode.models.loading import load_drafters, load_target
from specdecode.pipeline.schemas import register_schemas
from specdecode.routing.router import NO_DRAFTER, Router


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("domain")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--demo-dir", default="outputs/demo")
    parser.add_argument("--one-table", action="store_true")
    parser.add_argument("--groups", action="store_true", help="also routed, one batch per chosen drafter")
    parser.add_argument("overrides", nargs="*", help="conf/eval.yaml overrides, e.g. skinny_matmul=null")
    args = parser.parse_intermixed_args()
    if args.pairs < 1:
        parser.error(f"--pairs must be >= 1, got {args.pairs}")
    d = args.demo_dir
    register_schemas()
    overrides = [f"+drafters.{name}={d}/distill-{folder}/drafter" for name, folder in DRAFTERS.items()]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        raw = compose(
            "eval", overrides=[*overrides, f"router_dir={d}/fit", f"domains=[{args.domain}]", *args.overrides]
        )
    cfg = OmegaConf.to_object(raw)
    target, tokenizer = load_target(cfg.target, dtype=cfg.dtype, device="cpu", skinny_matmul=cfg.skinny_matmul)
    drafters = load_drafters(dict(cfg.drafters), target, tokenizer)
    prompts = heldout_prompts(tokenizer, cfg.data[args.domain], 8, cfg.max_prompt_tokens)
    texts, ids = [text for text, _ in prompts], [prompt for _, prompt in prompts]
    assign = [None if choice == NO_DRAFTER else choice for choice in Router.load(cfg.router_dir).choose(texts)]
    used = {name: drafters[name] for name in assign if name is not None}
    print("each prompt's drafter:", assign, flush=True)
    options = dict(max_new_tokens=128, temperature=args.temperature, seed=1)
    params = SamplingParams(args.temperature)
    rows = row_drafters(target, used, assign)
    policy = adaptive_gamma(target, rows, params)
    for batch in (1, 8):
        print(f"step table at batch {batch}, ms per gamma 0..:", [round(1e3 * s, 1) for s in policy.costs.at(batch)])

    def routed(gamma: object) -> Callable[[], object]:
        return lambda: speculative_generate(target, used, ids, assign=assign, gamma=gamma, **options)

    methods: dict[str, Callable[[], object]] = {
        "target": lambda: autoregressive_generate(target, ids, **options),
        "auto": routed("auto"),
    }
    if args.groups:
        methods["routed in groups"] = lambda: grouped(target, used, ids, assign, options)
    if args.one_table:
        first = next(iter(used.values()))
        one = AdaptiveGamma(step_table(target, first, params), drafter_alpha(first, args.temperature), calibrate=True)
        methods["auto, one table"] = routed(one)
    timed_pairs(methods, args.pairs, f"{args.domain} T={args.temperature}")
    recorded = speculative_generate(target, used, ids, assign=assign, gamma=policy, record=True, **options)
    steps_against_table(recorded, policy, rows.names)


def grouped(target: object, drafters: dict, ids: list[list[int]], assign: list[str | None], options: dict) -> None:
    """The routed prompts decoded one batch per chosen drafter (the target alone for no drafter), as
    the evaluation's `routed_grouped`."""
    for name in sorted(set(assign), key=assign.index):
        members = [prompt for prompt, choice in zip(ids, assign) if choice == name]
        if name is None:
            autoregressive_generate(target, members, **options)
        else:
            speculative_generate(target, drafters[name], members, gamma="auto", **options)


# The demo's drafters by router name, and their folders under --demo-dir (distill-<folder>).
DRAFTERS = {"generic": "mix", "code": "code", "math": "math", "chat": "chat"}


def timed_pairs(methods: dict[str, Callable[[], object]], pairs: int, label: str) -> None:
    """Each method once to warm up, then `pairs` rounds in turns; each method's median speedup over
    the first (the target alone), pair by pair."""
    for run in methods.values():
        run()
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    for pair in range(pairs):
        order = list(methods) if pair % 2 == 0 else list(reversed(methods))
        for name in order:
            start = time.perf_counter()
            methods[name]()
            seconds[name].append(time.perf_counter() - start)
        print(f"pair {pair}: " + ", ".join(f"{name} {seconds[name][-1]:.2f} s" for name in methods), flush=True)
    base = seconds["target"]
    for name in list(methods)[1:]:
        ratios = [b / s for b, s in zip(base, seconds[name])]
        print(
            f"{label} {name}: speedup median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
            f"max {max(ratios):.3f}) over {pairs} pairs; target alone median {statistics.median(base):.2f} s"
        )
    if "routed in groups" in seconds:
        ratios = [g / a for g, a in zip(seconds["routed in groups"], seconds["auto"])]
        print(
            f"{label} one batch over groups: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
            f"max {max(ratios):.3f})"
        )


def steps_against_table(result: GenerationResult, policy: AdaptiveGamma, names: tuple[str, ...]) -> None:
    """Each (batch size, gamma) of a recorded decode: its steps' measured and predicted milliseconds,
    each step predicted for the rows it had of each drafter (`AdaptiveGamma.seconds`)."""
    stats, record = result.stats, result.record or []
    print(f"recorded decode: alpha {stats.alpha}, tau {stats.tau:.3f}, steps by gamma {stats.gamma_steps}")
    steps: dict[float, tuple[list[str | None], int]] = defaultdict(lambda: ([], 0))
    for row in record:
        for step in row.steps[1:]:
            steps[step.time_s] = (steps[step.time_s][0] + [row.drafter], len(step.drafted))
    groups: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    previous = min(row.steps[0].time_s for row in record)
    for time_s, (drafters, gamma) in sorted(steps.items()):
        entry = groups[len(drafters), gamma]
        entry[0] += 1
        entry[1] += time_s - previous
        entry[2] += policy.seconds(len(drafters), [drafters.count(name) for name in names])[gamma]
        previous = time_s
    first = min(row.steps[0].time_s for row in record)
    print(
        f"wall {stats.wall_time_s:.2f} s: {first:.2f} s to the first token, {previous - first:.2f} s of steps after it"
    )
    print("batch gamma steps measured_ms predicted_ms ratio")
    for (batch, gamma), (count, measured, predicted) in sorted(groups.items()):
        per_step = f"{1e3 * measured / count:.1f} {1e3 * predicted / count:.1f}"
        print(f"{batch} {gamma} {count} {per_step} {measured / predicted:.2f}")


if __name__ == "__main__":
    main()
