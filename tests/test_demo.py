"""The demo pipeline end to end on tiny models (train → collect → fit → eval), and its caching."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specdecode.core.config import from_dict
from specdecode.pipeline.config import CONF_DIR, DemoConfig
from specdecode.pipeline.demo import demo_stages, run_demo


def markdown_links(text: str) -> list[str]:
    """The targets of the markdown links and images in `text`, in order."""
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)


SCHEMA = {
    "domain",
    "method",
    "gamma",
    "temperature",
    "batch_size",
    "alpha",
    "tau",
    "tokens_per_s",
    "speedup",
    "exact_match",
}


def smoke_config(output_dir: str, overrides: list[str] = ()) -> DemoConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        # In this process (fast); test_demo_app_runs_under_hydra_main goes through accelerate launch.
        cfg = compose(
            config_name="demo_smoke", overrides=[f"output_dir={output_dir}", "launcher=in_process", *overrides]
        )
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved.pop("hydra", None)
    # Everything under the test's folder, the teacher cache too.
    resolved["distill"] = [*resolved["distill"], f"cache_dir={output_dir}/teacher_cache"]
    return from_dict(DemoConfig, resolved)


# A second evaluation of the same drafters and router at shorter answers, greedy, batch 1.
SHORT_EVAL = "short_eval=['max_new_tokens=4','sweep_gammas=[]','temperatures=[0.0]','batch_sizes=[1]']"


def test_smoke_pipeline_end_to_end_and_cached(tmp_path, capsys) -> None:
    root = run_demo(smoke_config(str(tmp_path / "demo"), [SHORT_EVAL]))

    results = json.loads((root / "results.json").read_text())
    assert set(results) >= {"config", "rows"}
    methods = {r["method"] for r in results["rows"]}
    assert methods == {
        "autoregressive",
        "undistilled",
        "generic",
        "alldata",
        "specialized:code",
        "specialized:math",
        "specialized:chat",
        "routed",
        "oracle",
        "routed_choices",
    }
    for row in results["rows"]:
        assert SCHEMA <= set(row), row
        if row["temperature"] == 0.0:
            assert row["exact_match"] == 1.0, row
    # The gamma sweep (generic and routed) and sampled rows beside greedy.
    swept = {(r["method"], r["gamma"]) for r in results["rows"] if r["domain"] == "code" and r["temperature"] == 0.0}
    assert {g for m, g in swept if m == "generic"} == {g for m, g in swept if m == "routed"} == {1, 2, 3}
    assert any(r["temperature"] > 0 and r["method"] == "routed" for r in results["rows"])
    assert (root / "gamma_sweep.png").stat().st_size > 1000
    report = (root / "report.md").read_text()
    assert "| code | routed |" in report and "## Router" in report and "## Distillation" in report
    # every link and image of the published report (and of the evaluation's own) resolves from its file
    for path in (root / "report.md", root / "eval" / "report.md"):
        links = markdown_links(path.read_text())
        assert any(link.startswith(("tokens-", "eval/tokens-")) for link in links), path
        assert [link for link in links if not (path.parent / link).is_file()] == [], path
    # the router's share of the oracle's gain in every setting with an oracle, the sweep's rows left out
    shares = results["router_share"]
    assert {(s["temperature"], s["batch_size"]) for s in shares} == {
        (r["temperature"], r["batch_size"]) for r in results["rows"] if r["method"] == "oracle"
    }
    assert all("routed_share" in s for s in shares)
    assert "## The router's share of the oracle's gain" in report
    # one distillation row per drafter, naming its kind (the smoke demo trains slices)
    assert "| code | slice | forward_kl |" in report and "| mix | slice | forward_kl |" in report
    # routing against the all-data control: its figures, and the default drafter they give
    control = results["control"]
    assert set(control["domains"]) == {"code", "math", "chat"} and (control["batch_size"], control["gamma"]) == (1, 2)
    for d in control["domains"].values():
        by = d["judged_by"]  # alpha, or speedup where the router decoded plainly (no alpha)
        assert by == ("alpha" if d["routed_alpha"] is not None else "speedup")
        assert d["routed_beats"] == (d[f"routed_{by}"] > d[f"alldata_{by}"])
    beats = all(d["routed_beats"] for d in control["domains"].values())
    assert results["default_drafter"] == control["default_drafter"] == ("routed" if beats else "alldata")
    assert "## Routing against the all-data drafter (`alldata`)" in report and "| alldata |" in report
    for stage in ("distill-code", "distill-mix", "distill-alldata", "collect", "fit", "eval", "eval-short"):
        assert (root / stage / "STAGE.json").is_file()
    # every row says how long its answers were; the short evaluation's rows sit beside the main ones
    assert {r["max_new_tokens"] for r in results["rows"]} == {8}
    short = results["short_eval"]["rows"]
    assert {(r["max_new_tokens"], r["temperature"], r["batch_size"]) for r in short} == {(4, 0.0, 1)}
    assert {r["method"] for r in short} == methods and all(r["exact_match"] == 1.0 for r in short)
    assert "## The same drafters at 4 new tokens (stage `eval-short`)" in report
    # the domain jobs were fine-tuned from the generic drafter's folder (specialists_from: generic)
    job = OmegaConf.load(root / "distill-code" / "config.yaml")
    assert job.drafter.kind == "pretrained" and job.drafter.path == str(root / "distill-mix" / "drafter")

    # A second run with the same config does no work; changing the fit reruns fit and eval only.
    capsys.readouterr()
    run_demo(smoke_config(str(tmp_path / "demo"), [SHORT_EVAL]))
    assert capsys.readouterr().out.count("up to date") == 9
    run_demo(smoke_config(str(tmp_path / "demo"), [SHORT_EVAL, "fit=['epochs=5']"]))
    log = capsys.readouterr().out
    assert "[fit] done" in log and "[eval] done" in log and "[eval-short] done" in log
    assert "[collect] up to date" in log


def _user_domains(tmp_path: Path) -> Path:
    """A user's config folder with domains of their own: `tickets`, chat `messages` (a system turn,
    multi-turn, the last assistant turn the response) in a .parquet file, and `questions`, plain
    prompts without responses in a .jsonl file. (Prompt and response columns of
    .jsonl, .csv and .parquet files: test_data_files.)"""
    import datasets

    conf = tmp_path / "my_conf"
    (conf / "data").mkdir(parents=True)
    tickets = tmp_path / "tickets.parquet"
    datasets.Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "system", "content": "You are a billing assistant. Answer briefly."},
                    {"role": "user", "content": f"Ticket {i}: invoice {i * 3} is wrong."},
                    {"role": "assistant", "content": "Which line?"},
                    {"role": "user", "content": f"Line {i % 5}, charged twice."},
                    {"role": "assistant", "content": f"Refunded line {i % 5}."},
                ]
            }
            for i in range(200)
        ]
    ).to_parquet(str(tickets))
    (conf / "data" / "tickets.yaml").write_text(
        f"name: tickets\nsource: file\npath: {tickets}\nprompt_column: messages\n"
    )
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        "".join(json.dumps({"question": f"Why does order {i} show error {100 + i}?"}) + "\n" for i in range(60))
    )
    (conf / "data" / "questions.yaml").write_text(
        f"name: questions\nsource: file\npath: {questions}\nprompt_column: question\n"
    )
    return conf


def test_a_demo_that_would_train_on_missing_responses_stops_before_any_stage(tmp_path) -> None:
    """A prompts-only domain under settings that train on the data's own responses: the demo
    stops before its first stage, naming the file and the setting to change."""
    import subprocess

    out = tmp_path / "demo"
    command = _demo_app(tmp_path, "[code,questions]", out, "distill=['experiment=smoke','train.seq_source=data']")
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert completed.returncode != 0
    assert "questions.jsonl" in completed.stderr and "train.seq_source=target" in completed.stderr
    assert not out.exists() or not any(out.glob("distill-*"))


def _demo_app(tmp_path: Path, domains: str, out: Path, *overrides: str) -> list[str]:
    """`make demo`'s entry point at the smoke budget with the user's domains (`_user_domains`), to
    run in `tmp_path` (where the stages' relative paths, the teacher cache's among them, land)."""
    import sys

    return [
        sys.executable,
        str(CONF_DIR.parent / "eval" / "demo.py"),
        "--config-name",
        "demo_smoke",
        f"hydra.searchpath=[file://{_user_domains(tmp_path)}]",
        f"domains={domains}",
        f"output_dir={out}",
        "eval=['target.name=smoke','synthetic=true','undistilled.num_layers=1','undistilled.draft_vocab=null',"
        "'prompts_per_domain=2','max_prompt_tokens=256','max_new_tokens=4','gamma=2','temperatures=[0.0]',"
        "'batch_sizes=[1]']",
        "short_eval=[]",  # the second evaluation has its own test (test_smoke_pipeline_end_to_end_and_cached)
        *overrides,
    ]


def test_demo_app_runs_under_hydra_main_with_the_users_own_domains(tmp_path) -> None:
    """`make demo`'s entry point with two user domains beside a built-in one (chat `messages` with
    a system turn, and a file of plain prompts with no responses): stage configs are composed
    inside a running @hydra.main app whose search path holds the user's conf/data/, the training
    and evaluation stages run under `accelerate launch` (conf/accelerate/cpu.yaml), and every
    stage reads each domain's data from its own file (distill → collect → fit → eval → report)."""
    import subprocess

    out = tmp_path / "demo"
    command = _demo_app(tmp_path, "[code,tickets,questions]", out)  # demo_smoke.yaml's distill settings
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert {r["exact_match"] for r in results["rows"]} == {1.0}
    rows = {(r["domain"], r["method"]) for r in results["rows"]}
    for domain in ("code", "tickets", "questions"):
        assert {(domain, "routed"), (domain, f"specialized:{domain}"), (domain, "generic")} <= rows, domain
    # every stage read the user's files: the domain jobs, the generic drafter's mix, the labels
    assert json.loads((out / "distill-tickets" / "metrics.json").read_text())["data"] == "tickets"
    mix = OmegaConf.load(out / "distill-mix" / "config.yaml").data
    assert list(mix.domains) == ["code", "tickets", "questions"]
    assert mix.members.tickets.prompt_column == "messages"
    labelled = {json.loads(line)["domain"] for line in (out / "collect" / "labels.jsonl").read_text().splitlines()}
    assert labelled == {"code", "tickets", "questions"}
    assert "Ticket" in (out / "collect" / "labels.jsonl").read_text()  # the messages' text, not synthetic prompts
    # Each launched stage left its Hydra log (the app composed its own config) in its folder.
    for stage in ("distill-code", "distill-tickets", "distill-mix", "eval"):
        assert (out / stage / "hydra" / ".hydra" / "config.yaml").is_file(), stage
    assert not (out / "collect" / "hydra").exists()  # collect runs in the demo's process


def test_stage_wiring_survives_any_output_dir(tmp_path) -> None:
    """Paths reach the stage configs as values: quotes, commas, brackets or `${` in output_dir break nothing."""
    root = tmp_path / "it's, [a] ${b}=c"
    cfg = dataclasses.replace(smoke_config(str(tmp_path / "demo")), output_dir=str(root))
    stages = {stage.name: stage.config for stage in demo_stages(cfg)}
    drafters = {
        "code": root / "distill-code",
        "math": root / "distill-math",
        "chat": root / "distill-chat",
        "generic": root / "distill-mix",
    }
    assert {d["name"]: Path(d["path"]) for d in stages["collect"]["drafters"]} == {
        n: p / "drafter" for n, p in drafters.items()
    }
    assert {d["kind"] for d in stages["collect"]["drafters"]} == {"pretrained"} and stages["collect"][
        "domains"
    ] == cfg.domains
    assert stages["fit"]["labels"] == str(root / "collect" / "labels.jsonl")
    # the evaluation also has the all-data control, which the router does not choose
    assert {n: Path(p) for n, p in stages["eval"]["drafters"].items()} == {
        n: p / "drafter" for n, p in (drafters | {"alldata": root / "distill-alldata"}).items()
    }
    assert stages["eval"]["router_dir"] == str(root / "fit") and stages["eval"]["domains"] == cfg.domains
    assert stages["eval"]["max_new_tokens"] == 8  # the stage's own overrides still apply


def test_launched_stage_config_composes_back_to_the_same_config(tmp_path) -> None:
    """The file a launched app composes is the stage's config, key for key (what the stage hashed),
    typed by the app's schema; a `${` in a path stays literal."""
    from hydra import initialize_config_dir as init

    from specdecode.pipeline.launch import write_stage_config

    root = tmp_path / "odd ${x} 'dir'"
    stages = {
        s.name: s for s in demo_stages(dataclasses.replace(smoke_config(str(tmp_path / "demo")), output_dir=str(root)))
    }
    for stage, app, schema in (("distill-code", "distill", "TrainJobConfig"), ("eval", "eval", "EvalConfig")):
        config = stages[stage].config | {"output_dir": str(root / stage)}
        write_stage_config(app, config, tmp_path, tmp_path / "hydra")
        with init(config_dir=str(tmp_path), version_base="1.3"):
            composed = compose(config_name="stage")
        assert OmegaConf.get_type(composed).__name__ == schema
        resolved = OmegaConf.to_container(composed, resolve=True)
        assert resolved == json.loads(json.dumps(config)), stage


@pytest.mark.parametrize(
    "override, needle",
    [
        (
            "eval=['gamma=null','sweep_gammas=[1,2]']",
            r"^demo stage 'eval': gamma=None: an int or auto when sweep_gammas=\[1, 2\]",
        ),
        ("distill=['experiment=smoke','train.keep_checkpoints=1']", r"keep_checkpoints=1: at least 2"),
        (
            "short_eval=['max_prompt_tokens=10']",
            r"^demo stage 'eval-short': domain 'code' has only 0 held-out prompts within max_prompt_tokens=10, "
            r"and prompts_per_domain=3 are needed: .* \(the demo sets it in `short_eval`\)",
        ),
        (
            "collect=['cost_ratios=null','verify_ratio=1.2','max_prompt_tokens=10']",
            r"^demo stage 'collect': domain 'code': none of its \d+ prompts .* fits max_prompt_tokens=10 .* "
            r"set max_prompt_tokens to at least \d+ \(the demo sets it in `collect`\)",
        ),
    ],
)
def test_a_bad_stage_override_fails_before_any_stage_runs(tmp_path, monkeypatch, override: str, needle: str) -> None:
    """The evaluation's config is checked before the hour of stages ahead of it (the drafters and
    router it names do not exist yet, and that is not an error: `test_a_good_config_passes_the_stage_check`);
    a bad one stops the demo with nothing run and nothing written."""
    ran = spy_run_stages(monkeypatch)
    with pytest.raises(ValueError, match=needle):
        run_demo(smoke_config(str(tmp_path / "demo"), [override]))
    assert ran == [] and not (tmp_path / "demo" / "distill-code").exists()


class Ran(Exception):
    """Raised by `spy_run_stages` in place of running the demo's stages."""


def spy_run_stages(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the stages the demo would run, recorded; running them raises `Ran` instead."""
    import specdecode.pipeline.demo as demo

    ran: list[str] = []

    def run_stages(stages, *args):
        ran.extend(s.name for s in stages)
        raise Ran

    monkeypatch.setattr(demo, "run_stages", run_stages)
    return ran


def test_a_good_config_passes_the_stage_check(tmp_path, monkeypatch) -> None:
    ran = spy_run_stages(monkeypatch)
    with pytest.raises(Ran):
        run_demo(smoke_config(str(tmp_path / "ok")))
    assert "eval" in ran and "distill-code" in ran


def test_launch_failure_names_the_app_and_status(tmp_path) -> None:
    from specdecode.pipeline.config import accelerate_config_file
    from specdecode.pipeline.launch import launch_app

    config = smoke_config(str(tmp_path / "demo"))
    distill = demo_stages(config)[0].config | {"output_dir": str(tmp_path / "out")}
    distill["train"] = distill["train"] | {"keep_checkpoints": 1}  # the app's __post_init__ refuses it
    with pytest.raises(
        RuntimeError, match=r"^distill under accelerate launch exited with status 1: .*accelerate\.commands\.launch"
    ):
        launch_app("distill", distill, accelerate_config_file("cpu"), tmp_path / "hydra")


@pytest.mark.parametrize(
    "override, needle",
    [
        (
            "device=cuda:1 accelerate_config=cpu",
            r"accelerate_config='cpu' runs on the CPU \(use_cpu: true in .*cpu.yaml\) but device='cuda:1'",
        ),
        ("launcher=slurm", r"launcher='slurm': one of \['accelerate', 'in_process'\]"),
        (
            "accelerate_config=tpu_pod",
            r"accelerate_config='tpu_pod': no such accelerate config .*; "
            r"auto, one of \['cpu', 'multi_gpu', 'single_gpu'\]",
        ),
    ],
)
def test_bad_launcher_is_named(tmp_path, override: str, needle: str) -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="demo_smoke", overrides=override.split())
    with pytest.raises(ValueError, match=needle):
        OmegaConf.to_object(cfg)


def test_auto_accelerate_config_follows_the_device(tmp_path) -> None:
    """auto: the CPU config on the CPU, the single-GPU one on a GPU; a single process on cuda:N
    sees every GPU (the config's `gpu_ids: "0"` would hide N), a multi-process config keeps its own."""
    from specdecode.pipeline.config import accelerate_config_file
    from specdecode.pipeline.launch import launch_command

    assert accelerate_config_file("auto", "cpu") == CONF_DIR / "accelerate" / "cpu.yaml"
    single = accelerate_config_file("auto", "cuda:1")
    assert single == CONF_DIR / "accelerate" / "single_gpu.yaml"
    assert launch_command("distill", single, tmp_path, "cuda:1")[4:7] == [str(single), "--gpu_ids", "all"]
    assert "--gpu_ids" not in launch_command("distill", single, tmp_path, "cuda")
    multi = accelerate_config_file("multi_gpu", "cuda:1")
    assert "--gpu_ids" not in launch_command("eval", multi, tmp_path, "cuda:1")
    assert DemoConfig(device="cuda:1").accelerate_config == "auto"  # built on a CPU machine: nothing resolved yet


def test_the_generic_drafter_trains_on_the_union_of_the_domain_drafters_data(tmp_path) -> None:
    """The mix stage asks for every domain's budget, so its sequences are the domain stages' own
    cached ones (tests/test_train.py checks that such a job generates nothing new)."""
    stages = {s.name: s.config for s in demo_stages(smoke_config(str(tmp_path / "demo")))}
    domains = stages["distill-mix"]["data"]["domains"]
    assert len(domains) == 3
    for key in ("train_sequences", "heldout_sequences"):
        assert stages["distill-mix"]["train"][key] == len(domains) * stages["distill-code"]["train"][key]


def test_the_alldata_control_trains_on_the_domain_jobs_data_for_their_summed_budget(tmp_path) -> None:
    """The control reads every domain job's training sequences (a domain with more keeps them)
    for the generic and domain jobs' steps and minutes together, from the generic drafter's
    start; the evaluation alone uses it, and without the alldata method there is no such stage."""
    per_domain = "'train.train_sequences_per_domain.chat=20','train.max_minutes=0.5'"
    cache = f"distill=['experiment=smoke','cache_dir={tmp_path}/teacher_cache',{per_domain}]"
    stages = {s.name: s for s in demo_stages(smoke_config(str(tmp_path / "demo"), [cache]))}
    control, generic = stages["distill-alldata"].config, stages["distill-mix"].config
    jobs = [stages[f"distill-{name}"].config["train"] for name in ("mix", "code", "math", "chat")]
    base = stages["distill-code"].config["train"]["train_sequences"]
    assert control["train"]["train_sequences_per_domain"] == {"code": base, "math": base, "chat": 20}
    assert control["train"]["max_steps"] == sum(job["max_steps"] for job in jobs)
    assert control["train"]["max_minutes"] == sum(job["max_minutes"] for job in jobs) == 2.0
    assert control["train"]["heldout_sequences"] == generic["train"]["heldout_sequences"]
    assert control["drafter"] == generic["drafter"] and control["data"] == generic["data"]
    assert stages["eval"].config["drafters"]["alldata"] == str(tmp_path / "demo" / "distill-alldata" / "drafter")
    assert "distill-alldata" in stages["eval"].after and "distill-alldata" not in stages["collect"].after
    assert "alldata" not in {d["name"] for d in stages["collect"].config["drafters"]}
    without = "eval=['target.name=smoke','synthetic=true','methods=[autoregressive,generic,routed]']"
    names = [s.name for s in demo_stages(smoke_config(str(tmp_path / "demo"), [without, "short_eval=[]"]))]
    assert "distill-alldata" not in names
    with pytest.raises(ValueError, match="alldata"):
        DemoConfig(domains=["code", "alldata"])


@pytest.mark.parametrize("routed_alpha, default", [((0.6, 0.5), "routed"), ((0.6, 0.4), "alldata")])
def test_the_default_drafter_is_alldata_where_routing_does_not_beat_it(routed_alpha, default) -> None:
    """Greedy batch-1 rows at the evaluation's gamma decide (the sweep's and batch 8's do not);
    routing is the default only if its alpha is above the control's in every domain (its speedup,
    where the router decoded plainly: math), and the report names the domains where it is not,
    with both figures."""
    from specdecode.evaluation.control import control_comparison, control_section

    def row(domain: str, method: str, alpha: float | None, gamma: int = 3, batch: int = 1, speedup=1.2) -> dict:
        return dict(
            domain=domain, method=method, alpha=alpha, speedup=speedup, temperature=0.0, batch_size=batch, gamma=gamma
        )

    domains = ["code", "chat", "math"]
    rows = [row(d, "routed", a) for d, a in zip(("code", "chat"), routed_alpha)] + [
        row("math", "routed", None, speedup=1.3)
    ]
    rows += [row(d, "alldata", 0.45) for d in domains]
    rows += [row("chat", "routed", 0.9, gamma=4), row("chat", "routed", 0.9, batch=8)]  # neither counts
    comparison = control_comparison({"rows": rows, "config": {"gamma": 3, "domains": domains}})
    assert comparison["default_drafter"] == default and comparison["domains"]["code"]["routed_beats"]
    assert comparison["domains"]["math"]["judged_by"] == "speedup" and comparison["domains"]["math"]["routed_beats"]
    text = "\n".join(control_section(comparison, "out/distill-alldata/drafter"))
    if default == "alldata":
        assert (
            "on chat (alpha 0.400 vs 0.450)" in text
            and "default drafter is `alldata` (`out/distill-alldata/drafter`)" in text
        )
    else:
        assert "routing is the default" in text
    assert control_comparison({"rows": rows[:3], "config": {"gamma": 3, "domains": domains}}) is None


def test_a_domain_with_more_training_sequences_keeps_them_in_the_mix(tmp_path) -> None:
    """train.train_sequences_per_domain in the demo's distill overrides: that domain's job takes its
    own number, the others train_sequences; the mix names every domain's share and asks for their
    sum, so it still reads the domain stages' caches."""
    per_domain = "'train.train_sequences_per_domain.chat=20'"
    cache = f"distill=['experiment=smoke','cache_dir={tmp_path}/teacher_cache',{per_domain}]"
    stages = {
        s.name: s.config["train"]
        for s in demo_stages(smoke_config(str(tmp_path / "demo"), [cache]))
        if "train" in s.config
    }
    base = stages["distill-code"]["train_sequences"]
    assert (
        stages["distill-chat"]["train_sequences_per_domain"] == {"code": None, "math": None, "chat": 20} and base != 20
    )
    assert stages["distill-mix"]["train_sequences_per_domain"] == {"code": base, "math": base, "chat": 20}
    assert stages["distill-mix"]["train_sequences"] == 2 * base + 20


def test_distill_per_domain_reaches_that_domains_job_alone(tmp_path) -> None:
    stages = {
        s.name: s.config["train"]
        for s in demo_stages(smoke_config(str(tmp_path / "demo"), ["distill_per_domain.chat=['train.lr=0.25']"]))
        if "train" in s.config
    }
    assert stages["distill-chat"]["lr"] == 0.25
    assert all(stages[name]["lr"] != 0.25 for name in ("distill-mix", "distill-code", "distill-math"))
    with pytest.raises(ValueError, match="distill_per_domain"):
        DemoConfig(distill_per_domain={"bad name!": []})


def test_specialists_from_the_generic_drafter_train_after_it_and_start_from_it(tmp_path) -> None:
    """specialists_from=generic: the mix trains first and every domain job starts from its drafter
    folder (a stage after it, so a retrained generic drafter retrains them); the router and the
    evaluation still list the drafters domains first."""
    out = tmp_path / "demo"
    scratch = {s.name: s for s in demo_stages(smoke_config(str(out), ["specialists_from=scratch"]))}
    stages = demo_stages(smoke_config(str(out), ["specialists_from=generic"]))
    names = [s.name for s in stages if s.name.startswith("distill-")]
    assert names == ["distill-mix", "distill-code", "distill-math", "distill-chat", "distill-alldata"]
    by_name = {s.name: s for s in stages}
    assert by_name["distill-mix"].config == scratch["distill-mix"].config and by_name["distill-mix"].after == []
    for domain in ("code", "math", "chat"):
        stage = by_name[f"distill-{domain}"]
        assert stage.after == ["distill-mix"] and scratch[f"distill-{domain}"].after == []
        assert stage.config["drafter"]["kind"] == "pretrained"
        assert stage.config["drafter"]["path"] == str(out / "distill-mix" / "drafter")
        assert stage.config["data"] == scratch[f"distill-{domain}"].config["data"]
    assert [d["name"] for d in by_name["collect"].config["drafters"]] == ["code", "math", "chat", "generic"]
    with pytest.raises(ValueError, match="specialists_from='mix'"):
        smoke_config(str(out), ["specialists_from=mix"])


@pytest.mark.slow  # the fast wiring test above checks specialists_from; this runs the whole chain
def test_smoke_pipeline_with_specialists_from_scratch(tmp_path) -> None:
    """The demo's default is specialists_from=generic (test_smoke_pipeline_end_to_end_and_cached);
    scratch trains every drafter fresh, the domains first."""
    root = run_demo(smoke_config(str(tmp_path / "demo"), ["specialists_from=scratch"]))
    rows = json.loads((root / "results.json").read_text())["rows"]
    assert {r["exact_match"] for r in rows if r["temperature"] == 0.0} == {1.0}
    job = OmegaConf.load(root / "distill-code" / "config.yaml")
    assert job.drafter.kind != "pretrained"


def test_links_rebased_to_the_including_report_resolve_there(tmp_path) -> None:
    from specdecode.evaluation.report import rebase_links

    stage = tmp_path / "eval"
    stage.mkdir()
    (stage / "tokens-code.html").write_text("<html></html>")
    (stage / "speedup.png").write_bytes(b"png")
    text = "[code](tokens-code.html), ![s](speedup.png), [web](https://example.org/a.md), [top](#rows)"
    rebased = rebase_links(text, stage, tmp_path)
    assert markdown_links(rebased) == ["eval/tokens-code.html", "eval/speedup.png", "https://example.org/a.md", "#rows"]
    assert all((tmp_path / link).is_file() for link in markdown_links(rebased)[:2])
