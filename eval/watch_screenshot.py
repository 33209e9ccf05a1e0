"""A screenshot of the watch page mid-generation, taken by headless Chromium (`make watch-screenshot`).

    python eval/watch_screenshot.py                                   # docs/images/watch.png, SmolLM2-135M
    python eval/watch_screenshot.py --out /tmp/w.png target=smoke     # any eval/watch.py override after the flags

Needs the `browser` extra (selenium) and Chromium with its driver (Debian: `apt-get install
chromium chromium-driver`). The page is served on a free local port, the prompt typed and
submitted, and the shot taken once the target alone has streamed `--after` tokens: the
speculative answer is then complete beside a target-alone answer still coming in.
"""

import argparse
from pathlib import Path

from specdecode.core.config import from_dict
from specdecode.pipeline.schemas import compose_config
from specdecode.watch.browser import screenshot_mid_generation
from specdecode.watch.server import WatchServer
from specdecode.watch.watcher import WatchConfig, load_watcher

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--out", default="docs/images/watch.png")
parser.add_argument(
    "--prompt",
    default="Add type hints and a docstring to this function:\n\n"
    "def is_palindrome(s):\n    s = s.lower()\n    return s == s[::-1]",
)
parser.add_argument("--after", type=int, default=40, help="target-alone tokens on the page when the shot is taken")
parser.add_argument("overrides", nargs="*", help="eval/watch.py overrides, e.g. target=smoke max_new_tokens=64")
args = parser.parse_args()

cfg = from_dict(WatchConfig, compose_config("watch", [*args.overrides, "port=0"]))
server = WatchServer(load_watcher(cfg), cfg.host, 0).start()
try:
    count = screenshot_mid_generation(server.url, args.prompt, Path(args.out), min_tokens=args.after)
finally:
    server.stop()
print(f"{args.out}: speculative pane {count['spec']} tokens, target-alone pane {count['target']} tokens", end="")
print(" (the target alone was done)" if count["done"] else " (the target alone still streaming)")
