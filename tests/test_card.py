"""Model cards: the training job writes one into drafter/ (hub front matter, what was trained on what,
what it measured, the command), an evaluation can add figures, and push_to_hub uploads the folder
(a stand-in HfApi here: no network)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from specdecode.models import card
from specdecode.models.drafters import derive_drafter
from specdecode.models.smoke import smoke_tokenizer
from specdecode.training import job
from specdecode.training.config import TrainJobConfig
from tests.models_for_tests import tiny_llama

METRICS = {
    "job": "distill",
    "loss": "forward_kl",
    "acceptance_best": 0.61234,
    "best_step": 400,
    "steps": 420,
    "train_seconds": 1500.0,
    "train_tokens": 123456,
    "train_sequences": 2000,
    "heldout_sequences": 64,
    "heldout_positions": 4096,
    "draft_vocab": 8192,
    "num_processes": 1,
    "selection_metric": "greedy acceptance",
    "gamma": {
        "chosen": 3,
        "speedup": 1.81,
        "method": "timed decodes",
        "tau": {3: 2.9},
        "prompts": 8,
        "max_new_tokens": 64,
    },
}


def front_matter(path: Path) -> dict:
    text = path.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n", 2)[1])


class FakeHub:
    """Records what push_to_hub asks of the hub."""

    calls: list = []

    def __init__(self, token=None) -> None:
        self.calls.append(("init", token))

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, folder_path, repo_id, **kwargs):
        self.calls.append(("upload_folder", folder_path, repo_id, sorted(p.name for p in Path(folder_path).iterdir())))
        return type("Commit", (), {"commit_url": f"https://hub/{repo_id}/commit/1"})()


@pytest.fixture
def fake_hub(monkeypatch):
    FakeHub.calls = []
    monkeypatch.setattr(card, "HfApi", FakeHub)
    return FakeHub


def test_the_training_job_writes_a_card_and_pushes_only_when_asked(tmp_path, fake_hub) -> None:
    drafter = derive_drafter(tiny_llama(2, vocab_size=259), 1)
    cfg = TrainJobConfig(output_dir=str(tmp_path / "run"))
    cfg.target.revision = "abc123"
    job._save(cfg, drafter, smoke_tokenizer(), METRICS, accelerator=None)
    folder = tmp_path / "run" / "drafter"
    meta = front_matter(folder / "README.md")
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["library_name"] == "transformers" and meta["datasets"] == ["openai/openai_humaneval"]
    assert {"speculative-decoding", "code"} <= set(meta["tags"])
    facts = meta["specdecode"]
    assert facts["target_revision"] == "abc123" and facts["drafter"]["kind"] == "derived"
    assert facts["training"] == facts["training"] | {"steps": 420, "max_steps": cfg.train.max_steps, "minutes": 25.0}
    measured = {m["metric"]: m for m in facts["measured"]}
    assert measured["acceptance"]["value"] == 0.6123 and "64 held-out code sequences" in measured["acceptance"]["on"]
    assert measured["speedup"]["value"] == 1.81 and measured["tau"]["value"] == 2.9
    text = (folder / "README.md").read_text()
    assert "| speedup | 1.81 | gamma 3 over target-only decoding" in text and "```bash\n" in text
    assert fake_hub.calls == []  # push_to_hub is off by default

    cfg = dataclasses.replace(cfg, output_dir=str(tmp_path / "pushed"), push_to_hub="me/code-drafter")
    job._save(cfg, drafter, smoke_tokenizer(), METRICS, accelerator=None)
    assert fake_hub.calls[1] == (
        "create_repo",
        "me/code-drafter",
        {"private": True, "exist_ok": True, "repo_type": "model"},
    )
    assert fake_hub.calls[2][:3] == ("upload_folder", str(tmp_path / "pushed" / "drafter"), "me/code-drafter")
    assert "README.md" in fake_hub.calls[2][3] and "model.safetensors" in fake_hub.calls[2][3]


def test_push_to_hub_checks_before_it_uploads(tmp_path, fake_hub) -> None:
    with pytest.raises(ValueError, match="no README.md|not a folder with a README.md"):
        card.push_to_hub(tmp_path, "me/drafter")
    (tmp_path / "README.md").write_text("---\n---\n")
    with pytest.raises(ValueError, match="push_to_hub='drafter'"):
        card.push_to_hub(tmp_path, "drafter")
    assert fake_hub.calls == []
    assert card.push_to_hub(tmp_path, "me/drafter", private=False, token="t") == "https://hub/me/drafter/commit/1"
    assert fake_hub.calls[0] == ("init", "t") and fake_hub.calls[1][2]["private"] is False
    with pytest.raises(ValueError, match="push_to_hub"):
        TrainJobConfig(push_to_hub="no-owner")


@pytest.mark.parametrize(
    "name, expected",
    [
        ("smoke", None),
        ("org/model", "org/model"),
        ("./org/model", None),
        ("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ],
)
def test_base_model_is_a_hub_id_or_absent(name, expected) -> None:
    assert card.hub_id(name) == expected


def test_the_command_is_the_one_typed() -> None:
    assert (
        card.command_line(["/v/bin/python", "-m", "specdecode.pipeline.cli", "train", "data=my code"])
        == "specdecode train 'data=my code'"
    )
    assert card.command_line(["/v/bin/python", "/v/bin/specdecode", "demo"]) == "specdecode demo"
    assert card.command_line(["python3", "train/distill.py", "loss=tvd"]) == "python train/distill.py loss=tvd"
