"""The data writer's response tokens/s, settings side by side, in turns.

    python scripts/writer_speed.py                               # the demo's writer and the alternatives
    python scripts/writer_speed.py --prompts 128 --rounds 3 --settings "bfloat16,64,eager" "bfloat16,16,eager"
    python scripts/writer_speed.py --temperatures 0.0 0.7 --settings "bfloat16,64,apart" "bfloat16,64,eager"

The target writes the continuations a `train/distill.py` job with the demo's settings writes
(`data=<domain>`, 48 new tokens, the feature drafter's layers captured) for the domain's first
`--prompts` training prompts, one continuation per prompt and `--temperatures` entry (default greedy
only), once per setting and round, the settings in turns (the order reversed every other round).
A setting is `dtype,generation_batch,eager|apart|compiled|speculative`; the first is the baseline,
and each row prints its median tokens/s and its median ratio to the baseline, round by round.
`eager` is the writer (a prompt's continuations share one prefill); `apart` writes each temperature
in a call of its own. `speculative` writes with `--drafter` (the demo's code drafter) at
`gamma="auto"`, without capturing features (the writer does not draft): it shows whether
speculation would pay at that batch.
"""

import argparse
import statistics
import time

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specdecode.core.config import TEMPERATURE_RANGE, is_temperature
from specdecode.core.paths import CONF_DIR
from specdecode.data.domains import format_prompt
from specdecode.decoding.decode import speculative_generate
from specdecode.models.loading import cast_copy, load_model, load_target, reads_features
from specdecode.pipeline.schemas import register_schemas
from specdecode.training.sequences import generate_continuations, load_examples

# The demo's writer: the distill job's data precision (auto: bf16 on a CPU that computes it), its
# generation_batch, eager; then one setting changed at a time.
SETTINGS = [
    "bfloat16,64,eager",
    "float32,64,eager",
    "bfloat16,16,eager",
    "bfloat16,128,eager",
    "bfloat16,64,compiled",
    "bfloat16,8,eager",
    "bfloat16,8,speculative",
]
MODES = ("eager", "apart", "compiled", "speculative")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domain", default="code")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    parser.add_argument(
        "--settings", nargs="+", default=SETTINGS, help="dtype,generation_batch,eager|apart|compiled|speculative"
    )
    parser.add_argument("--drafter", default="outputs/demo/distill-code/drafter", help="for speculative settings")
    args = parser.parse_args()
    settings = [parse_setting(text, parser) for text in args.settings]
    if args.prompts < 1 or args.rounds < 1:
        parser.error(f"--prompts and --rounds must be >= 1, got {args.prompts} and {args.rounds}")
    bad = [t for t in args.temperatures if not is_temperature(t)]
    if bad:
        parser.error(f"--temperatures must each be {TEMPERATURE_RANGE}, got {bad}")
    register_schemas()
    overrides = [f"data={args.domain}", "drafter=feature", f"train.max_new_tokens={args.new_tokens}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = OmegaConf.to_object(compose("distill", overrides=overrides))
    target, tokenizer = load_target(cfg.target, dtype="float32", device="cpu")
    layers = reads_features(cfg.drafter, target.config.num_hidden_layers)
    train = cfg.train
    examples = load_examples(cfg.data, "train")[: args.prompts]
    prompts = [format_prompt(tokenizer, ex)[-train.max_prompt_tokens :] for ex in examples]
    eos = [tokenizer.eos_token_id]
    models = {dtype: cast_copy(target, getattr(torch, dtype)) for dtype in {s[0] for s in settings}}
    drafters = {}
    if any(mode == "speculative" for _, _, mode in settings):
        drafter, _ = load_model(args.drafter)
        drafters = {dtype: drafter.to(getattr(torch, dtype)) for dtype, _, mode in settings if mode == "speculative"}
    budgets = [min(train.max_new_tokens, train.max_len - len(p)) for p in prompts]

    def write(setting: tuple[str, int, str]) -> tuple[float, int]:
        dtype, batch, mode = setting
        start = time.perf_counter()
        if mode == "speculative":
            written = [
                seq
                for temperature in args.temperatures
                for i in range(0, len(prompts), batch)
                for seq in speculative_generate(
                    models[dtype],
                    drafters[dtype],
                    prompts[i : i + batch],
                    gamma="auto",
                    max_new_tokens=budgets[i : i + batch],
                    temperature=temperature,
                    eos_token_ids=eos,
                    seed=i,
                ).sequences
            ]
            return time.perf_counter() - start, sum(len(w) for w in written)
        calls = [[t] for t in args.temperatures] if mode == "apart" else [args.temperatures]
        written = [
            seq
            for temperatures in calls
            for seq in generate_continuations(
                models[dtype],
                prompts,
                train,
                eos,
                seed=0,
                batch_size=batch,
                temperature=temperatures,
                feature_layers=layers,
                compile=mode == "compiled",
            )[0]
        ]
        return time.perf_counter() - start, sum(len(w) for w in written)

    print(
        f"{len(prompts)} {args.domain} prompts, up to {args.new_tokens} new tokens, T={args.temperatures}, "
        f"feature layers {layers}; warm-up call per setting",
        flush=True,
    )
    for setting in settings:
        write(setting)
    rates: dict[int, list[float]] = {i: [] for i in range(len(settings))}
    for round_ in range(args.rounds):
        order = list(range(len(settings)))
        for i in order if round_ % 2 == 0 else reversed(order):
            seconds, tokens = write(settings[i])
            rates[i].append(tokens / seconds)
            print(
                f"round {round_} {args.settings[i]}: {tokens} tokens in {seconds:.1f} s, {tokens / seconds:.0f} tok/s",
                flush=True,
            )
    print(f"| setting | tok/s (median of {args.rounds}) | ratio to {args.settings[0]} (median) |\n|---|---|---|")
    for i, text in enumerate(args.settings):
        ratio = statistics.median(r / b for r, b in zip(rates[i], rates[0]))
        print(f"| {text} | {statistics.median(rates[i]):.0f} | {ratio:.2f}× |")


def parse_setting(text: str, parser: argparse.ArgumentParser) -> tuple[str, int, str]:
    """`dtype,generation_batch,mode` → (dtype, batch, mode); a parser error otherwise."""
    parts = text.split(",")
    if (
        len(parts) != 3
        or parts[0] not in ("float32", "bfloat16")
        or not parts[1].isdigit()
        or int(parts[1]) < 1
        or parts[2] not in MODES
    ):
        parser.error(f"setting {text!r}: expected dtype,generation_batch,{'|'.join(MODES)}, e.g. bfloat16,64,eager")
    return parts[0], int(parts[1]), parts[2]


if __name__ == "__main__":
    main()
