"""`python tests/kill_after_step.py N train/<job>.py <overrides>`: run a training app whose loop is
SIGKILLed as it begins step N + 1, once steps 1..N and their evaluations and checkpoints are done:
the crash that tests/test_train.py resumes from. The hook lives here, not in the training loop."""

import os
import runpy
import signal
import sys

from specdecode.training import loop

kill_after = int(sys.argv[1])
batch_indices = loop.global_batch_indices


def batch_indices_or_kill(step: int, *args: int) -> list[int]:
    """The loop's batch of 0-based `step`, asked for as that step begins: steps 1..step are done."""
    if step == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
    return batch_indices(step, *args)


loop.global_batch_indices = batch_indices_or_kill
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
