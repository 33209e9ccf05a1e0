"""specdecode as an installed tool: the wheel ships conf/ inside the package and the `specdecode`
command; dependencies are ranges; the command dispatches to the apps and exports drafters; and,
installed into a fresh venv, `specdecode demo --config-name demo_smoke` runs from another folder."""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from specdecode.core.paths import CONF_DIR
from specdecode.models.feature_drafter import derive_feature_drafter
from specdecode.models.smoke import smoke_target, smoke_tokenizer
from specdecode.pipeline import cli, launch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel` builds from a copy of the checkout (setuptools writes build/ beside
    the sources, which must not land in the working tree)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("specdecode", "conf"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return next(out.glob("specdecode-*.whl"))


def test_the_wheel_ships_the_configs_and_the_command(wheel) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"specdecode/conf/{p.relative_to(ROOT / 'conf')}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert configs and configs <= names, sorted(configs - names)
    assert "specdecode/pipeline/cli.py" in names and not any(n.startswith(("tests/", "train/", "eval/")) for n in names)
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert "specdecode = specdecode.pipeline.cli:main" in entry_points
    requires = email.message_from_bytes(zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA")).get_all("Requires-Dist")
    pinned = [
        r
        for r in requires
        if r.split("==")[0].strip() in {"torch", "transformers", "datasets", "hydra-core", "sentence-transformers"}
        and "==" in r
    ]
    assert not pinned, pinned
    assert any(
        r.replace(" ", "").startswith("torch<2.15,>=2.4") or r.replace(" ", "").startswith("torch>=2.4,<2.15")
        for r in requires
    )


def test_the_apps_find_their_configs_in_a_checkout() -> None:
    assert CONF_DIR == ROOT / "conf" and (CONF_DIR / "demo_smoke.yaml").is_file()


def saved_drafter(folder: Path) -> Path:
    """A feature drafter of the smoke target, saved as the training job saves one."""
    drafter = derive_feature_drafter(smoke_target(), 1, draft_vocab=list(range(0, 259, 2)), layout="eagle")
    with torch.no_grad():
        drafter.fc.weight.normal_(0, 0.3)
    drafter.save_pretrained(folder)
    smoke_tokenizer().save_pretrained(folder)
    return folder


def test_export_from_the_command_line(tmp_path, capsys) -> None:
    drafter = saved_drafter(tmp_path / "run" / "drafter")
    out = cli.export(
        [
            f"drafter={drafter}",
            "format=sglang-eagle",
            f"output={tmp_path / 'sglang'}",
            "target=smoke",
            "num_speculative_tokens=4",
        ]
    )
    readme = (out / "README.md").read_text()
    assert (
        "--speculative-algorithm EAGLE --speculative-draft-model-path" in readme
        and "--speculative-num-steps 4" in readme
    )
    assert f"--speculative-token-map {out}/hot_token_map.pt" in readme
    # the target defaults to the one the training config beside the drafter names
    (tmp_path / "run" / "config.yaml").write_text(OmegaConf.to_yaml({"target": {"name": "smoke"}}))
    out = cli.export([f"drafter={drafter}", "format=vllm-eagle", f"output={tmp_path / 'vllm'}"])
    assert '"method": "eagle"' in (out / "README.md").read_text()
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["format=trt", "output=x", "drafter=d"], "format='trt': expected one of vllm-eagle"),
        (["format=vllm-eagle", "output=x"], "missing drafter="),
        (["format=vllm-eagle", "output=x", "drafter=d", "gamma=3"], "unexpected argument 'gamma=3'"),
        (["format=vllm-eagle", "output=x", "drafter=d", "num_speculative_tokens=0"], "num_speculative_tokens='0'"),
        (["format=vllm-eagle", "output=x", "drafter=/nowhere/drafter"], "drafter='/nowhere/drafter': no such"),
        (["format=vllm-eagle", "output=x", "drafter=/nowhere/drafter", "target=smoke"], "no such drafter folder"),
        (["format=vllm-eagle", "output=x", "drafter={here}"], "no target= given"),
    ],
)
def test_export_arguments_are_checked_before_any_model_loads(args, message, tmp_path) -> None:
    with pytest.raises(SystemExit, match=message):
        cli.export([arg.format(here=tmp_path) for arg in args])


def test_the_command_dispatches_to_the_apps(capsys) -> None:
    cli.main(["--help"])
    assert "specdecode demo --config-name demo_smoke" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown app 'serve'"):
        cli.main(["serve"])
    cli.main(["train", "experiment=smoke", "data=math", "--cfg", "job"])  # Hydra prints the composed config
    composed = OmegaConf.create(capsys.readouterr().out)
    assert composed.target.name == "smoke" and composed.data.name == "math" and composed.train.max_steps == 6


def test_launched_stages_run_the_module_where_no_script_is(tmp_path, monkeypatch) -> None:
    assert launch._program("train/distill.py", "train") == [str(ROOT / "train" / "distill.py")]
    monkeypatch.setattr(launch, "ROOT", tmp_path)
    assert launch._program("eval/acceptance.py", "eval") == ["-m", "specdecode.pipeline.cli", "eval"]


@pytest.mark.slow
def test_installed_wheel_runs_the_smoke_demo_from_another_folder(wheel, tmp_path) -> None:
    """A fresh venv with the wheel installed (--no-deps; its dependencies come from this venv's
    site-packages through a .pth path, which runs none of this venv's .pth hooks, so the checkout's
    editable install stays out), then `specdecode demo --config-name demo_smoke` in an empty folder."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        timeout=300,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run(
        [python, "-c", "import specdecode; print(specdecode.__file__)"],
        cwd=elsewhere,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert where.startswith(str(site)), where
    completed = subprocess.run(
        [venv / "bin" / "specdecode", "demo", "--config-name", "demo_smoke"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert (elsewhere / "outputs" / "demo_smoke" / "report.md").is_file()
    assert (elsewhere / "outputs" / "demo_smoke" / "distill-code" / "drafter" / "README.md").is_file()
