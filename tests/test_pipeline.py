"""Stage caching: skip when unchanged, rerun a changed stage and everything downstream, never trust a
half-written stage."""

from __future__ import annotations

import pytest

from specdecode.pipeline.stages import Stage, code_fingerprint, finished_record, run_stages


def make_stages(calls: list[str], train_steps: int = 5, fail: str | None = None) -> list[Stage]:
    def work(name: str):
        def run(config: dict, out) -> None:
            calls.append(name)
            if name == fail:
                raise RuntimeError("killed")
            (out / "output.txt").write_text(f"{name} {config}")

        return run

    return [
        Stage("train", {"steps": train_steps}, work("train")),
        Stage("collect", {"n": 3}, work("collect"), after=["train"]),
        Stage("bench", {"x": 1}, work("bench")),
        Stage("eval", {"k": 1}, work("eval"), after=["collect", "bench"]),
    ]


def test_second_run_skips_everything(tmp_path) -> None:
    calls: list[str] = []
    run_stages(make_stages(calls), tmp_path)
    run_stages(make_stages(calls), tmp_path)
    assert calls == ["train", "collect", "bench", "eval"]


def test_changed_config_reruns_the_stage_and_downstream_only(tmp_path) -> None:
    calls: list[str] = []
    run_stages(make_stages(calls), tmp_path)
    calls.clear()
    out = run_stages(make_stages(calls, train_steps=7), tmp_path)
    assert calls == ["train", "collect", "eval"]
    assert (out["train"] / "output.txt").read_text() == "train {'steps': 7}"


def test_a_failed_stage_is_not_taken_as_finished(tmp_path) -> None:
    calls: list[str] = []
    with pytest.raises(RuntimeError):
        run_stages(make_stages(calls, fail="collect"), tmp_path)
    assert finished_record(tmp_path / "collect") is None
    calls.clear()
    run_stages(make_stages(calls), tmp_path)
    assert calls == ["collect", "bench", "eval"]


def test_stage_order_is_checked(tmp_path) -> None:
    stages = [Stage("eval", {}, lambda c, o: None, after=["train"]), Stage("train", {}, lambda c, o: None)]
    with pytest.raises(ValueError, match="'eval' runs after 'train'"):
        run_stages(stages, tmp_path)


def test_changed_code_reruns_every_stage(tmp_path, capsys) -> None:
    calls: list[str] = []
    run_stages(make_stages(calls), tmp_path, code="v1")
    run_stages(make_stages(calls), tmp_path, code="v1")
    assert calls == ["train", "collect", "bench", "eval"]
    calls.clear()
    capsys.readouterr()
    run_stages(make_stages(calls), tmp_path, code="v2")
    assert calls == ["train", "collect", "bench", "eval"]
    assert "[train] the code or a package changed since it ran (v1 -> v2): rerunning" in capsys.readouterr().out


def test_code_fingerprint_follows_the_sources_and_package_versions(tmp_path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text("x = 1\n")
    (package / "sub" / "b.py").write_text("y = 2\n")
    (package / "notes.txt").write_text("not code")
    first = code_fingerprint([package], ["torch"])
    assert code_fingerprint([package], ["torch"]) == first  # deterministic
    (package / "notes.txt").write_text("still not code")
    assert code_fingerprint([package], ["torch"]) == first
    (package / "sub" / "b.py").write_text("y = 3\n")
    edited = code_fingerprint([package], ["torch"])
    assert edited != first
    (package / "sub" / "b.py").rename(package / "b2.py")  # same bytes, another module
    assert code_fingerprint([package], ["torch"]) != edited
    # A package's version is part of it: torch is installed, this name is not.
    assert code_fingerprint([package], ["torch"]) != code_fingerprint([package], ["no-such-distribution-xyz"])


def test_each_launched_app_names_the_command_that_runs_its_script() -> None:
    """An installed wheel ships no scripts: a launched stage runs `specdecode <command>` instead."""
    from specdecode.pipeline.cli import HYDRA_APPS
    from specdecode.pipeline.launch import APPS

    for script, _, command in APPS.values():
        assert HYDRA_APPS[command][2] == script


def test_every_app_and_stage_function_named_by_a_string_resolves_to_a_callable() -> None:
    """The console script and the demo's in-process stages import their functions by name when
    they run, so a renamed function would surface only then: each name is checked here."""
    import importlib

    from specdecode.pipeline.cli import HYDRA_APPS
    from specdecode.pipeline.demo import _SCHEMAS

    names = [function for _, function, _ in HYDRA_APPS.values()] + [s[3] for s in _SCHEMAS.values()]
    for name in names:
        module, _, function = name.partition(":")
        assert callable(getattr(importlib.import_module(module), function, None)), name
