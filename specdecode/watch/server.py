"""The watch as a local web page (`eval/watch.py serve=true`) on http.server: `GET /` is the page;
`GET /events?prompt=...` streams Server-Sent Events (`route`, then `tokens` per step and `done` for
the speculative decode and for the target alone, then `end`).
"""

from __future__ import annotations

import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TextIO
from urllib.parse import parse_qs, urlparse

from specdecode.decoding.record import StepEvent
from specdecode.routing.router import NO_DRAFTER
from specdecode.watch.render import CSS, PieceDecoder, legend_html
from specdecode.watch.watcher import Watcher

PAGE = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>specdecode: watch it work</title>
<style>{CSS}
body{{max-width:80rem}} .panes{{display:grid;grid-template-columns:1fr 1fr;gap:1rem}}
textarea{{width:100%;font:inherit}} .rate{{font-weight:600}}</style></head><body>
<h1>specdecode: watch it work</h1>
<form id="form"><textarea id="prompt" rows="3" placeholder="Type a prompt"></textarea>
<button id="go" type="submit">Generate</button></form>
<p id="route"></p>
{legend_html()}
<div class="panes">
<div><h3>speculative decoding <span id="spec-drafter"></span> · <span class="rate" id="spec-rate">–</span></h3>
<div class="answer" id="spec"></div><p class="summary" id="spec-done"></p></div>
<div><h3>target alone · <span class="rate" id="target-rate">–</span></h3>
<div class="answer" id="target"></div><p class="summary" id="target-done"></p></div>
</div>
<p class="summary" id="end"></p>
<script>
const $ = (id) => document.getElementById(id);
let source = null;
$("form").addEventListener("submit", (event) => {{
  event.preventDefault();
  if (source) source.close();
  const cleared = ["spec", "target", "spec-done", "target-done", "route", "end", "spec-drafter"];
  for (const id of cleared) $(id).textContent = "";
  $("spec-rate").textContent = $("target-rate").textContent = "–";
  source = new EventSource("/events?prompt=" + encodeURIComponent($("prompt").value));
  const on = (name, fn) => source.addEventListener(name, (e) => fn(JSON.parse(e.data)));
  on("route", (d) => {{
    $("route").textContent = d.routed
      ? "router's choice: " + d.drafter + " (routing took " + d.routing_ms.toFixed(1) + " ms)"
      : "drafter: " + d.drafter;
    $("spec-drafter").textContent = "(" + d.drafter + ")";
  }});
  on("tokens", (d) => {{
    for (const [text, kind] of d.tokens) {{
      const span = document.createElement("span");
      span.className = "t k-" + kind; span.title = kind; span.textContent = text;
      $(d.pane).appendChild(span);
    }}
    $(d.pane + "-rate").textContent = d.tokens_per_s.toFixed(1) + " tokens/s (" + d.count + " tokens)";
  }});
  on("done", (d) => {{
    if (d.tail && $(d.pane).lastChild) $(d.pane).lastChild.textContent += d.tail;
    $(d.pane + "-rate").textContent = d.tokens_per_s.toFixed(1) + " tokens/s (" + d.count + " tokens)";
    $(d.pane + "-done").textContent = "done: " + d.count + " tokens in " + d.seconds.toFixed(2) + " s, tau " +
      d.tau.toFixed(2);
  }});
  on("end", (d) => {{
    $("end").textContent = d.speedup ? "speculative decoding: " + d.speedup.toFixed(2) + "× the target alone" : "";
    source.close();
  }});
  on("failure", (d) => {{ $("end").textContent = "error: " + d.message; source.close(); }});
}});
</script></body></html>
"""


class _Cancelled(Exception):
    """The page went away: stop decoding its prompt."""


def stream_answer(watcher: Watcher, text: str, send: Any, stop: threading.Event | None = None) -> None:
    """Decode `text` with its drafter, then with the target alone, calling `send(event, data)` for
    each Server-Sent Event. `stop` set: the decode ends at its next step."""
    name, routing_s = watcher.choose(text)
    send("route", {"drafter": name, "routed": watcher.router is not None, "routing_ms": 1000 * routing_s})
    ids = watcher.prompt_ids(text)
    rates = {}
    for pane, drafter in (("spec", name), ("target", NO_DRAFTER)):
        decoder, count = PieceDecoder(watcher.tokenizer), 0

        def on_step(event: StepEvent, pane: str = pane, decoder: PieceDecoder = decoder) -> None:
            nonlocal count
            if stop is not None and stop.is_set():
                raise _Cancelled
            tokens = [(decoder.push(t), kind) for row in event.tokens for t, kind in row]
            count += len(tokens)
            rate = count / event.time_s if event.time_s > 0 else 0.0
            send("tokens", {"pane": pane, "tokens": tokens, "count": count, "tokens_per_s": rate})

        stats = watcher.decode(ids, drafter, on_step=on_step).stats
        rates[pane] = stats.tokens_per_s
        done = {"count": stats.generated_tokens, "seconds": stats.wall_time_s, "tokens_per_s": stats.tokens_per_s}
        # `tail`: text held back at the end of the answer (`PieceDecoder.flush`), the last token's
        send("done", {"pane": pane, "tau": stats.tau, "tail": decoder.flush()} | done)
    send("end", {"speedup": rates["spec"] / rates["target"] if rates["target"] else None})


class WatchServer:
    """The page and its event stream on `host:port` (0: any free port), served from a thread."""

    def __init__(self, watcher: Watcher, host: str = "127.0.0.1", port: int = 8000) -> None:
        self.watcher = watcher
        self.lock = threading.Lock()  # one decode at a time
        server = self

        class Handler(_Handler):
            watch = server

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}/"

    def start(self) -> WatchServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop serving, and wait (up to `timeout_s`) for a decode in flight."""
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.lock.acquire(timeout=timeout_s):
            self.lock.release()


class _Handler(BaseHTTPRequestHandler):
    watch: WatchServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        """Quiet: the terminal shows the URL, not every request."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        url = urlparse(self.path)
        if url.path == "/":
            body = PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif url.path == "/events":
            prompt = parse_qs(url.query).get("prompt", [""])[0].strip()
            self._events(prompt)
        else:
            self.send_error(404)

    def _events(self, prompt: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        events: queue.Queue = queue.Queue()
        stop = threading.Event()

        def work() -> None:
            try:
                if not prompt:
                    raise ValueError("the prompt is empty")
                with self.watch.lock:
                    stream_answer(self.watch.watcher, prompt, lambda name, data: events.put((name, data)), stop)
            except _Cancelled:
                pass
            except Exception as error:  # shown on the page, not lost in a thread
                events.put(("failure", {"message": f"{type(error).__name__}: {error}"}))
            events.put(None)

        # The decode runs in its own thread and this one writes: a slow socket never stalls a step.
        threading.Thread(target=work, daemon=True).start()
        while (item := events.get()) is not None:
            name, data = item
            if stop.is_set():
                continue
            try:
                self.wfile.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                stop.set()


def serve_forever(watcher: Watcher, host: str, port: int, out: TextIO) -> None:
    """Serve the page until interrupted (Ctrl-C)."""
    server = WatchServer(watcher, host, port)
    out.write(f"watch it work: open {server.url}  (Ctrl-C stops)\n")
    out.flush()
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
