"""`python tests/kill_after_shard.py N train/<job>.py <overrides>`: run a training app that is
SIGKILLed while it writes its teacher stores, as it publishes its (N + 1)-th shard file: that
shard's bytes are on disk in a temp file, not renamed into place, and N shards are complete. The
crash that tests/test_train_store.py resumes from. The hook lives here, not in the store."""

import os
import runpy
import signal
import sys

kill_at = int(sys.argv[1]) + 1
published = 0
replace = os.replace


def replace_or_kill(src: str, dst: str) -> None:
    """`os.replace`, except for the shard that is the (N + 1)-th: the process dies first."""
    global published
    if str(dst).endswith(".safetensors"):
        published += 1
        if published == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    replace(src, dst)


os.replace = replace_or_kill  # type: ignore[assignment]
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
