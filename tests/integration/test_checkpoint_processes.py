"""Local checkpoints under a real crash: a child process saving in a loop is SIGKILLed (the
round trip, atomic writes, verification, rotation and fallback: tests/test_checkpoint.py)."""

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from diloco_node.ops.checkpoint import CheckpointStore
from diloco_node.testbed.launcher import REPO

pytestmark = pytest.mark.integration


def test_sigkill_during_a_save_loop_always_leaves_a_loadable_checkpoint(tmp_path):
    """A real crash: a child process saves in a loop and is SIGKILLed at an arbitrary moment."""
    script = textwrap.dedent(
        f"""
        import numpy as np, sys
        from diloco_node.ops.checkpoint import CheckpointStore
        store = CheckpointStore({str(tmp_path)!r}, keep=2)
        big = np.zeros(2_000_000, dtype=np.float32)
        step = 0
        while True:
            big[0] = step
            store.save({{"step": step}}, {{"big": big}})
            step += 1
            if step == 2:
                print("saving", flush=True)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             cwd=REPO)
    try:
        assert child.stdout.readline().strip() == b"saving"
        time.sleep(0.15)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    with CheckpointStore(tmp_path, keep=2) as store:
        result = store.load_latest()
    assert result is not None and result.skipped == ()
    step = result.checkpoint.meta["step"]
    assert step >= 1 and result.checkpoint.arrays["big"][0] == step
