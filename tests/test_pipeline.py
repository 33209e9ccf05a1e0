"""Stage caching: skip when unchanged, rerun a changed stage and everything downstream, never trust a half-written stage."""

from __future__ import annotations

import pytest

from specdecode.pipeline.stages import Stage, finished_key, run_stages


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
    assert finished_key(tmp_path / "collect") is None
    calls.clear()
    run_stages(make_stages(calls), tmp_path)
    assert calls == ["collect", "bench", "eval"]


def test_stage_order_is_checked(tmp_path) -> None:
    stages = [Stage("eval", {}, lambda c, o: None, after=["train"]), Stage("train", {}, lambda c, o: None)]
    with pytest.raises(ValueError, match="'eval' runs after 'train'"):
        run_stages(stages, tmp_path)
