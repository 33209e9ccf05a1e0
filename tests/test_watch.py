"""The views on the per-token record: the terminal watch (eval/watch.py on the smoke target), the
self-contained HTML page and the evaluation's token pages, the local web page's event stream, and
(marked `browser`) the page in headless Chromium."""

from __future__ import annotations

import io
import json
import re
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

from specdecode import autoregressive_generate, speculative_generate
from specdecode.core.config import from_dict
from specdecode.decoding.lookup import PromptLookup
from specdecode.decoding.record import KINDS
from specdecode.evaluation.config import EvalConfig
from specdecode.evaluation.suite import run_eval
from specdecode.models import derive_drafter
from specdecode.models.config import TargetConfig
from specdecode.models.smoke import smoke_target, smoke_tokenizer
from specdecode.pipeline.schemas import compose_config
from specdecode.watch.browser import find_chromium, screenshot_mid_generation
from specdecode.watch.render import STYLES, Answer, pieces, token_page
from specdecode.watch.server import WatchServer
from specdecode.watch.terminal import run_watch
from specdecode.watch.watcher import WatchConfig, Watcher
from tests.test_evaluation import tiny_setup  # noqa: F401 (a fixture)

PROMPT = "the cat sat on the mat, the cat sat on the"


class Spans(HTMLParser):
    """The (text, kind) of every token span (`class="t k-<kind>"`), the CSS, and any external asset."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[tuple[str, str]] = []
        self.css = ""
        self.external: list[str] = []
        self._in: str | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attrs = dict(attrs)
        if tag in ("link", "img", "script") and (attrs.get("src") or attrs.get("href")):
            self.external.append(tag)
        classes = (attrs.get("class") or "").split()
        if tag == "span" and "t" in classes:
            self._in = next(c.removeprefix("k-") for c in classes if c.startswith("k-"))
            self.tokens.append(("", self._in))
        self._style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._in = None
        self._style = False

    def handle_data(self, data: str) -> None:
        if self._in is not None:
            self.tokens[-1] = (self.tokens[-1][0] + data, self._in)
        elif getattr(self, "_style", False):
            self.css += data


@pytest.fixture(scope="module")
def watcher() -> Watcher:
    target = smoke_target(num_layers=2)
    return Watcher(
        target,
        smoke_tokenizer(),
        {"derived": derive_drafter(target, 1)},
        max_new_tokens=24,
        temperature=0.0,
        seed=0,
        gamma=3,
        prompt_lookup=PromptLookup(max_confidence=1.0),
    )


def greedy_text(watcher: Watcher, text: str, max_new_tokens: int = 24) -> str:
    ids = watcher.prompt_ids(text)
    out = autoregressive_generate(watcher.target, [ids], max_new_tokens=max_new_tokens).sequences[0]
    return watcher.tokenizer.decode(out, skip_special_tokens=True)


def test_html_page_parses_and_colours_every_token_by_its_kind(watcher) -> None:
    ids = watcher.prompt_ids(PROMPT)
    result = speculative_generate(
        watcher.target, watcher.drafters["derived"], [ids], max_new_tokens=24, gamma=3, record=True
    )
    row = result.record[0]
    answer = Answer(PROMPT, "derived", pieces(watcher.tokenizer, row), row.tau, result.stats.tokens_per_s)
    escaped = Answer("<b>bold?</b>", "x", [("<b>", "accepted"), ("&amp;", "corrected")], 1.0, 1.0)
    page = Spans()
    page.feed(token_page("tokens", [answer, escaped]))
    # every generated token is one span of its record's kind, with its text (markup escaped)
    assert page.tokens == answer.tokens + escaped.tokens
    assert [kind for _, kind in page.tokens[: len(row.tokens())]] == [kind for _, kind in row.tokens()]
    assert "".join(text for text, _ in answer.tokens) == greedy_text(watcher, PROMPT)
    for kind, style in STYLES.items():
        assert f".k-{kind}{{background:{style.background}}}" in page.css
    assert not page.external


def test_watch_app_prints_coloured_answers_on_the_smoke_target() -> None:
    config = compose_config(
        "watch", ["target=smoke", f"prompts=['{PROMPT}']", "max_new_tokens=12", "drafter.num_layers=1"]
    )
    cfg = from_dict(WatchConfig, config)
    out = io.StringIO()
    (answer,) = run_watch(cfg, out=out)
    text = out.getvalue()
    assert answer.drafter == "untrained derived" and answer.tau >= 1.0 and answer.target_tokens_per_s > 0
    # every token printed in its kind's colour, and the answer is the target's own greedy text
    for piece, kind in answer.tokens:
        if piece:
            assert f"\x1b[{STYLES[kind].ansi}m{piece}\x1b[0m" in text
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text)
    assert f"> {PROMPT}" in plain and "tokens/s" in plain and "target alone" in plain
    # the smoke target as the watch loads it (load_model("smoke")): no drafter needed for its greedy text
    assert "".join(t for t, _ in answer.tokens) == greedy_text(
        Watcher(smoke_target(), smoke_tokenizer(), {}), PROMPT, 12
    )
    # prompts typed on stdin, one a line (blank lines skipped)
    answers = run_watch(from_dict(WatchConfig, config | {"prompts": []}), stdin=io.StringIO("a b\n\nc d\n"), out=out)
    assert [a.prompt for a in answers] == ["a b", "c d"]


class _ByWord:
    """A router stub: "code" in the text routes to the code drafter, "plain" to no drafter, else generic."""

    drafters = ["code", "generic", "none"]

    def choose(self, texts: list[str]) -> list[str]:
        return ["code" if "code" in t else "none" if "plain" in t else "generic" for t in texts]


def test_watch_routes_with_a_demos_router_and_drafters(tmp_path: Path) -> None:
    """demo_dir names the router (fit/) and the drafters (distill-mix for generic, distill-<name>)."""
    target, tokenizer = smoke_target(), smoke_tokenizer()
    for folder, layers in (("distill-mix", 1), ("distill-code", 2)):
        derive_drafter(target, layers).save_pretrained(tmp_path / folder / "drafter")
        tokenizer.save_pretrained(tmp_path / folder / "drafter")
    (tmp_path / "fit").mkdir()
    config = compose_config("watch", ["target=smoke", f"demo_dir={tmp_path}", "max_new_tokens=6"])
    cfg = from_dict(WatchConfig, config | {"prompts": ["some code", "a plain one", "anything"]})
    answers = run_watch(cfg, out=io.StringIO(), router_loader=lambda path: _ByWord())
    assert [a.drafter for a in answers] == ["code", "none", "generic"]
    assert {kind for _, kind in answers[1].tokens} == {"target"}  # no drafter: the target alone
    (tmp_path / "distill-code" / "drafter" / "config.json").unlink()
    with pytest.raises(ValueError, match="drafters.code"):
        run_watch(cfg, out=io.StringIO(), router_loader=lambda path: _ByWord())


def test_watch_config_names_bad_values_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="compile"):
        WatchConfig(target=TargetConfig(name="smoke"), compile=True)
    with pytest.raises(ValueError, match="one drafter folder without router_dir"):
        WatchConfig(drafters={"a": str(tmp_path), "b": str(tmp_path)})
    with pytest.raises(ValueError, match="demo_dir"):
        WatchConfig(demo_dir=str(tmp_path))  # no fit/ in it
    with pytest.raises(ValueError, match="port"):
        WatchConfig(port=70000)


def read_events(url: str) -> list[tuple[str, dict]]:
    events, name = [], None
    with urllib.request.urlopen(url, timeout=60) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        for line in response:
            line = line.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
                if name in ("end", "failure"):
                    break
    return events


def test_web_page_streams_a_prompt_on_localhost(watcher) -> None:
    server = WatchServer(watcher, "127.0.0.1", 0).start()
    try:
        with urllib.request.urlopen(server.url, timeout=30) as response:
            page = response.read().decode()
        assert "EventSource" in page and "<script src" not in page
        events = read_events(server.url + "events?prompt=" + urllib.parse.quote(PROMPT))
        bad = read_events(server.url + "events?prompt=")
    finally:
        server.stop()
    names = [name for name, _ in events]
    assert names[0] == "route" and events[0][1]["drafter"] == "derived"
    assert names[-1] == "end" and names.count("done") == 2
    panes = {"spec": [], "target": []}
    for name, data in events:
        if name == "tokens":
            panes[data["pane"]] += data["tokens"]
            assert data["count"] == len(panes[data["pane"]]) and data["tokens_per_s"] > 0
    done = {data["pane"]: data for name, data in events if name == "done"}
    assert {kind for _, kind in panes["target"]} == {"target"}
    assert {kind for _, kind in panes["spec"]} <= set(KINDS) and "corrected" in {k for _, k in panes["spec"]}
    # greedy: the speculative answer is the target's own, token for token (`tail`: text held back
    # at the end, an answer cut inside a character)
    assert [t for t, _ in panes["spec"]] == [t for t, _ in panes["target"]]
    assert "".join(t for t, _ in panes["spec"]) + done["spec"]["tail"] == greedy_text(watcher, PROMPT)
    assert done["spec"]["count"] == len(panes["spec"]) == done["target"]["count"]
    assert events[-1][1]["speedup"] == pytest.approx(done["spec"]["tokens_per_s"] / done["target"]["tokens_per_s"])
    assert bad == [("failure", {"message": "ValueError: the prompt is empty"})]


def test_evaluation_writes_token_pages_beside_the_report(tiny_setup) -> None:  # noqa: F811
    tmp_path, folders = tiny_setup
    cfg = EvalConfig(
        target=TargetConfig(name=str(tmp_path / "target")),
        drafters={"generic": folders["generic"]},
        domains=["code"],
        methods=["autoregressive", "generic"],
        prompts_per_domain=2,
        max_prompt_tokens=150,
        max_new_tokens=6,
        gamma=2,
        temperatures=[0.0],
        batch_sizes=[1],
        token_pages=1,
        output_dir=str(tmp_path / "eval"),
    )
    run_eval(cfg)
    page = Spans()
    page.feed((tmp_path / "eval" / "tokens-code.html").read_text())
    assert 1 <= len(page.tokens) <= 6 and {kind for _, kind in page.tokens} <= set(KINDS)
    assert "(tokens-code.html)" in (tmp_path / "eval" / "report.md").read_text()


@pytest.mark.browser
def test_page_in_headless_chromium_streams_tokens(watcher, tmp_path: Path) -> None:
    pytest.importorskip("selenium", reason="the browser extra (selenium) is not installed")
    if find_chromium() is None:
        pytest.skip("no chromium and chromedriver on the PATH")
    server = WatchServer(watcher, "127.0.0.1", 0).start()
    try:
        shot = tmp_path / "watch.png"
        count = screenshot_mid_generation(server.url, PROMPT, shot, min_tokens=1, timeout_s=60)
    finally:
        server.stop()
    assert shot.read_bytes().startswith(b"\x89PNG") and count["spec"] > 0
