"""A domain is data, not code: user domains from files and config folders, chat `messages` columns,
the same held-out split for every source, and bad input that names the domain, file or column."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from specdecode.data.config import DataConfig
from specdecode.data.domains import format_prompt, heldout_score, load_domain, prompts_within
from specdecode.data.example import Example
from specdecode.data.registry import domain_data, domain_examples, require_heldout, resolve_domains
from specdecode.evaluation.config import EvalConfig
from specdecode.models.config import DrafterConfig, TargetConfig
from specdecode.models.smoke import smoke_tokenizer
from specdecode.pipeline.config import DemoConfig
from specdecode.training.sequences import load_examples

CHAT = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Reset my password?"},
            {"role": "assistant", "content": "Use the link."},
            {"role": "user", "content": "It expired."},
            {"role": "assistant", "content": "I sent a new one."},
        ]
    },
    {"messages": [{"role": "user", "content": "Where is my order 42?"}]},
]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _user_conf(tmp_path: Path, name: str, **fields: object) -> Path:
    """A user's config folder holding data/<name>.yaml, as `hydra.searchpath` would add it."""
    conf = tmp_path / "conf"
    (conf / "data").mkdir(parents=True, exist_ok=True)
    lines = [f"name: {name}"] + [f"{k}: {json.dumps(v)}" for k, v in fields.items()]
    (conf / "data" / f"{name}.yaml").write_text("\n".join(lines) + "\n")
    return conf


def test_a_messages_column_is_a_prompt_ending_at_its_last_user_turn(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "support.jsonl", CHAT)
    first, second = load_domain("support", source="file", path=path, split="all", prompt_column="messages")
    assert first.messages == (
        ("system", "Be brief."),
        ("user", "Reset my password?"),
        ("assistant", "Use the link."),
        ("user", "It expired."),
    )
    assert first.response == "I sent a new one." and first.domain == "support"
    assert (
        first.prompt == "system: Be brief.\n\nuser: Reset my password?\n\nassistant: Use the link.\n\nuser: It expired."
    )
    # one user turn is the same prompt as the plain text: the same hash, so the same held-out membership
    assert second.prompt == "Where is my order 42?" and second.response is None
    assert heldout_score(second.prompt) == heldout_score("Where is my order 42?")


def test_format_prompt_renders_messages_with_the_targets_chat_template() -> None:
    tokenizer = smoke_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    example = Example(
        prompt="x", response=None, domain="support", messages=(("user", "hi"), ("assistant", "yo"), ("user", "bye"))
    )
    assert tokenizer.decode(format_prompt(tokenizer, example)) == "<user>hi<assistant>yo<user>bye<assistant>"
    assert tokenizer.decode(format_prompt(tokenizer, "hi")) == "<user>hi<assistant>"


@pytest.mark.parametrize(
    ("cell", "named"),
    [
        ([], "a non-empty list"),
        ([{"role": "user"}], "turn 0 must be a {role, content} mapping"),
        ([{"role": "wizard", "content": "x"}], "role 'wizard'"),
        ([{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}], "has no user turn"),
        ([["user", "hi"]], "turn 0 must be"),
    ],
)
def test_bad_messages_name_domain_file_column_and_row(tmp_path: Path, cell: object, named: str) -> None:
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "fine"}]}, {"messages": cell}])
    with pytest.raises(ValueError, match=r"domain 'support', file '.*chat\.jsonl', column 'messages', row 1") as raised:
        load_domain("support", source="file", path=path, split="all", prompt_column="messages")
    assert named in str(raised.value)


def test_a_prompt_cell_that_is_not_text_is_refused(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "odd.jsonl", [{"q": {"text": "hi"}}])
    with pytest.raises(ValueError, match=r"column 'q', row 0: a prompt must be text or a messages list, got dict"):
        load_domain("odd", source="file", path=path, split="all", prompt_column="q")


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".json", ".csv", ".parquet"])
def test_a_user_domain_reads_every_file_format(tmp_path: Path, suffix: str) -> None:
    rows = [{"question": f"How do I fix error {i}?", "answer": f"Do step {i}."} for i in range(40)]
    path = tmp_path / f"support{suffix}"
    if suffix == ".jsonl":
        _jsonl(path, rows)
    elif suffix == ".jsonl.gz":
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in rows)
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".csv":
        path.write_text("question,answer\n" + "".join(f"{r['question']},{r['answer']}\n" for r in rows))
    else:
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(path))
    data = DataConfig(name="support", source="file", path=str(path), prompt_column="question", response_column="answer")
    examples = domain_examples(data, "all")
    assert [e.prompt for e in examples] == [r["question"] for r in rows]
    assert examples[3].response == "Do step 3." and {e.domain for e in examples} == {"support"}
    # the held-out split is the prompt hash, as for every other source
    assert [e.prompt for e in domain_examples(data, "heldout")] == [
        r["question"] for r in rows if heldout_score(r["question"]) < 0.1
    ]


def test_a_domain_is_found_on_the_search_path_and_mixes_with_built_in_ones(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "support.jsonl", CHAT)
    conf = _user_conf(tmp_path, "support", source="file", path=str(path), prompt_column="messages")
    support = domain_data("support", extra=[f"file://{conf}"])
    assert (support.source, support.path, support.prompt_column) == ("file", str(path), "messages")
    mix = DataConfig(
        name="mix",
        domains=["code", "support"],
        synthetic=True,
        members={"support": resolve_domains(["support"], {"support": support.__dict__})["support"]},
    )
    assert [p.name for p in mix.parts()] == ["code", "support"]
    assert [p.source for p in mix.parts()] == ["embedded", "file"]  # synthetic replaces embedded data only
    examples = load_examples(mix, "all")
    assert {e.domain for e in examples} == {"code", "support"}
    assert "Where is my order 42?" in {e.prompt for e in examples}


def test_unknown_and_clashing_domains_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown domain 'legal': no data/legal.yaml in the config search path"):
        domain_data("legal")
    path = _jsonl(tmp_path / "code.jsonl", [{"prompt": "def f():"}])
    conf = _user_conf(tmp_path, "code", source="file", path=str(path))
    with pytest.raises(
        ValueError,
        match=r"domain 'code' is defined twice, differently: .*conf/data/code.yaml \(source 'embedded'\) "
        r"and .*code.yaml \(source 'file'\) \(a built-in domain: give yours another name\)",
    ):
        domain_data("code", extra=[conf])
    with pytest.raises(ValueError, match=r"data.source \(domain 'x'\)='ftp': embedded\|hf\|file\|synthetic"):
        DataConfig(name="x", source="ftp")
    with pytest.raises(ValueError, match=r"domain 'support' has no embedded data"):
        load_domain("support", split="all")


def test_bad_data_files_are_named_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data.path \(domain 'support'\)='/no/such.jsonl': does not exist"):
        DataConfig(name="support", source="file", path="/no/such.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"data.path \(domain 'support'\)='.*empty.jsonl': is empty"):
        DataConfig(name="support", source="file", path=str(empty))
    path = _jsonl(tmp_path / "support.jsonl", [{"question": "q?"}])
    data = DataConfig(name="support", source="file", path=str(path))
    with pytest.raises(
        ValueError,
        match=r"column 'prompt' not found in domain 'support', file '.*support.jsonl'; "
        r"available columns: \['question'\]",
    ):
        domain_examples(data)


def test_too_few_heldout_prompts_say_how_many_there_are(tmp_path: Path) -> None:
    rows = [{"prompt": f"question number {i}"} for i in range(60)]
    path = _jsonl(tmp_path / "small.jsonl", rows)
    have = sum(heldout_score(r["prompt"]) < 0.1 for r in rows)
    data = {"small": DataConfig(name="small", source="file", path=str(path)).__dict__}
    with pytest.raises(
        ValueError, match=rf"domain 'small' has {have} held-out prompts but prompts_per_domain=50 were asked for"
    ):
        require_heldout(data, 50, "prompts_per_domain")
    require_heldout(data, have, "prompts_per_domain")


def test_stage_configs_take_any_domain_and_carry_its_data(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "support.jsonl", CHAT)
    given = {"support": DataConfig(name="support", source="file", path=str(path), prompt_column="messages").__dict__}
    cfg = EvalConfig(methods=["autoregressive"], domains=["code", "support"], data=given, synthetic=True)
    assert cfg.data["support"]["path"] == str(path) and cfg.data["code"]["synthetic"] is True
    with pytest.raises(ValueError, match=r"domains=\[\]: a non-empty list"):
        EvalConfig(methods=["autoregressive"], domains=[])
    with pytest.raises(ValueError, match=r"drafters=.*'legal'.*generic or one of domains"):
        EvalConfig(methods=["autoregressive"], domains=["code"], drafters={"legal": str(tmp_path)})
    # routed traffic of another domain: the drafters are the router's, checked when it loads
    routed = EvalConfig(
        methods=["autoregressive", "routed"], domains=["mixed"], drafters={"code": str(tmp_path)}, router_dir="r"
    )
    assert list(routed.drafters) == ["code"]
    demo = DemoConfig(domains=["code", "support"], launcher="in_process")
    assert demo.loss("support") == "forward_kl"  # a domain the demo has never seen gets the defaults


def test_target_options_are_checked_and_reach_from_pretrained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specdecode.models import loading

    cfg = TargetConfig(name="org/model", revision="abc123", trust_remote_code=True, attn_implementation="sdpa")
    seen: dict[str, dict] = {}

    class Stop(Exception):
        pass

    def from_pretrained(source: str, **kwargs: object) -> None:
        seen[source] = kwargs
        raise Stop

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    with pytest.raises(Stop):
        loading.load_target(cfg)
    assert seen["org/model"] | {} == {
        "dtype": seen["org/model"]["dtype"],
        "revision": "abc123",
        "trust_remote_code": True,
        "attn_implementation": "sdpa",
    }
    with pytest.raises(ValueError, match=r"target.attn_implementation='fast'"):
        TargetConfig(attn_implementation="fast")
    with pytest.raises(ValueError, match=r"target.device_map='balanced'"):
        TargetConfig(device_map="balanced")
    with pytest.raises(ValueError, match=r"device_map='auto' spreads a model over GPUs: it needs device=cuda"):
        loading.load_target(TargetConfig(name="org/model", device_map="auto"))
    with pytest.raises(ValueError, match=r"revision='v1' applies to hub ids; '.*' is local"):
        loading.load_target(TargetConfig(name=str(tmp_path), revision="v1"))
    with pytest.raises(ValueError, match=r"drafter.trust_remote_code='yes': true or false"):
        DrafterConfig(kind="pretrained", path="org/drafter", draft_vocab=None, trust_remote_code="yes")


def test_a_model_that_needs_remote_code_says_so(tmp_path: Path) -> None:
    from specdecode.models.loading import load_target

    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "my_custom_lm",
                "architectures": ["MyCustomLM"],
                "auto_map": {
                    "AutoConfig": "configuration_custom.MyConfig",
                    "AutoModelForCausalLM": "modeling_custom.MyCustomLM",
                },
            }
        )
    )
    (folder / "configuration_custom.py").write_text("raise RuntimeError('remote code ran')\n")
    smoke_tokenizer().save_pretrained(folder)
    with pytest.raises(
        ValueError, match=r"runs its own model code .*set trust_remote_code=true \(target.trust_remote_code"
    ):
        load_target(TargetConfig(name=str(folder)))


def test_the_demo_refuses_an_unknown_domain_before_any_stage(tmp_path: Path) -> None:
    from specdecode.pipeline.demo import demo_stages
    from tests.test_demo import smoke_config

    cfg = smoke_config(str(tmp_path / "demo"), ["domains=[code,legal]"])
    with pytest.raises(ValueError, match=r"unknown domain 'legal': no data/legal.yaml in the config search path"):
        demo_stages(cfg)
    assert not (tmp_path / "demo").exists()


def test_the_evaluation_counts_heldout_prompts_before_loading_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specdecode.evaluation import suite

    path = _jsonl(tmp_path / "small.jsonl", [{"prompt": f"question number {i}"} for i in range(60)])
    data = {"small": DataConfig(name="small", source="file", path=str(path)).__dict__}
    cfg = EvalConfig(
        target=TargetConfig(name="smoke"),
        methods=["autoregressive"],
        domains=["small"],
        data=data,
        prompts_per_domain=50,
        output_dir=str(tmp_path / "eval"),
    )
    monkeypatch.setattr(
        suite, "load_target", lambda *a, **k: pytest.fail("the target loaded before the data was checked")
    )
    with pytest.raises(ValueError, match=r"domain 'small' has \d+ held-out prompts but prompts_per_domain=50"):
        suite.run_eval(cfg)


def test_prompts_within_skips_prompts_over_the_limit_and_never_cuts_one() -> None:
    tokenizer = smoke_tokenizer()
    examples = [Example(prompt=text, response=None, domain="chat") for text in ("hi", "a much longer prompt", "yo")]
    limit = len(format_prompt(tokenizer, "hi"))
    kept = list(prompts_within(tokenizer, examples, limit))
    assert [example.prompt for example, _ in kept] == ["hi", "yo"]
    assert all(ids == format_prompt(tokenizer, example) and len(ids) <= limit for example, ids in kept)
