"""A crash failpoint exits the process at once and drops what was not fsynced, in a real process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from diloco_node.storage import failpoints

WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from diloco_node.storage import durable, failpoints
    failpoints.load_from_env()
    path = Path(sys.argv[1])
    durable.track(path)
    with open(path, "ab") as handle:
        for record in (b"one;", b"two;", b"three;"):
            handle.write(record)
            handle.flush()
            durable.sync_file("log.append", handle.fileno(), path)
    print("finished")
""")


@pytest.mark.parametrize(("action", "kept"), [("crash-before@2", b"one;"), ("crash-after@2", b"one;two;")])
def test_a_crash_at_an_fsync_keeps_only_what_was_fsynced(tmp_path, action, kept):
    path = tmp_path / "log.bin"
    # `@2`: the first fsync passes, the second crashes (before or after it syncs)
    done = subprocess.run([sys.executable, "-c", WRITER, str(path)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, failpoints.ENV_VAR: f"log.append={action}"})
    assert done.returncode == failpoints.CRASH_EXIT_CODE, done.stderr
    assert "finished" not in done.stdout and "failpoint log.append: crashing" in done.stderr
    assert path.read_bytes() == kept
