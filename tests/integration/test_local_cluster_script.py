"""`examples/local-cluster.sh` run for real, as a user runs it: two sites (`NODES=2`) start, the
joiner once the founder's `/livez` answers; the joiner's first start fails as a refused join does
(exit 3) and the script starts it again; both report ready and apply a merged fragment; Ctrl-C
(SIGINT to the script) stops both cleanly. The script runs in a session of its own, so whatever
it started is killed at teardown, also when an assertion fails. Its `--dry-run` prints four
`diloco-node run` commands that `config show` accepts.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import pytest

from diloco_node.testbed.launcher import REPO, free_port, node_env

from conftest import config_show, local_status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SCRIPT = REPO / "examples" / "local-cluster.sh"
# A bound for a hung start, not a measured duration: two tiny sites on two shared cores compile
# and merge in about 20-40 s.
DEADLINE_S = 180.0
STOP_TIMEOUT_S = 60.0


@contextlib.contextmanager
def _ctrl_c_as_in_a_terminal() -> Iterator[None]:
    """Start children with SIGINT handled, as a terminal gives it.

    A test run started in the background of a non-interactive shell (`pytest ... &`, as CI jobs
    often are) has SIGINT ignored, every child inherits that, and bash cannot trap a signal that
    was ignored when it started: the script would never see the Ctrl-C. A handled signal is reset
    to its default in the child at exec, so a handler here for the duration of the start is enough.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _two_free_ports() -> int:
    """A port p with p + 1 free too (the script uses BASE_PORT and BASE_PORT + 1 here)."""
    for _ in range(50):
        base = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def _merged(document: dict[str, Any] | None) -> bool:
    """Ready, and at least one fragment has taken a merged round."""
    return bool(document and document["ready"] and max(f["round"] for f in document["fragments"]) >= 1)


# NODE_CMD for the script: site-b's first start exits 3 (what `diloco-node run` returns when the run
# refuses it or no bootstrap peer answers); every other start is the real node.
FLAKY_NODE = """#!/usr/bin/env bash
if [[ " $* " == *" --data-dir $CLUSTER_DIR/site-b "* && ! -e "$CLUSTER_DIR/site-b.refused" ]]; then
    touch "$CLUSTER_DIR/site-b.refused"
    echo "diloco-node run: refused (test)" >&2
    exit 3
fi
exec "$X_PYTHON" -m diloco_node "$@"
"""


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL whatever is left of the script's session (the script and every node it started)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


def test_local_cluster_script_starts_two_sites_retries_a_failed_join_and_stops_them_on_ctrl_c(tmp_path: Path) -> None:
    base = _two_free_ports()
    cluster_dir = tmp_path / "cluster"
    node_cmd = tmp_path / "flaky-node"
    node_cmd.write_text(FLAKY_NODE)
    node_cmd.chmod(0o755)
    environ = node_env({"CLUSTER_DIR": str(cluster_dir), "BASE_PORT": str(base), "NODES": "2",
                        "NODE_CMD": str(node_cmd), "X_PYTHON": sys.executable,
                        "READY_TIMEOUT_S": str(int(DEADLINE_S))})
    output_path = tmp_path / "script.out"
    with output_path.open("wb") as output:
        with _ctrl_c_as_in_a_terminal():
            script = subprocess.Popen(["bash", str(SCRIPT)], env=environ, stdout=output, stderr=subprocess.STDOUT,
                                      cwd=tmp_path, start_new_session=True)
    try:
        documents: list[dict[str, Any] | None] = [None, None]
        deadline = time.monotonic() + DEADLINE_S
        while not all(_merged(d) for d in documents):
            assert script.poll() is None, f"the script exited ({script.returncode}):\n{output_path.read_text()}"
            assert time.monotonic() < deadline, f"no merge on both sites:\n{output_path.read_text()}"
            time.sleep(1.0)
            documents = [local_status(base), local_status(base + 1)]
        founder, joiner = documents
        assert founder is not None and joiner is not None
        assert (founder["node_id"], joiner["node_id"]) == ("site-a", "site-b")
        assert founder["run_id"] == joiner["run_id"]
        assert {m["node_id"] for m in joiner["members"]} == {"site-a", "site-b"}
        # The script prints "all nodes ready" after its own readiness poll, which may come after
        # both sites have already merged: wait for the line rather than assume it is there.
        while "all nodes ready" not in output_path.read_text():
            assert script.poll() is None, f"the script exited ({script.returncode}):\n{output_path.read_text()}"
            assert time.monotonic() < deadline, f"the script never said all nodes ready:\n{output_path.read_text()}"
            time.sleep(0.5)
        shown = output_path.read_text()
        assert f"site-a live at http://127.0.0.1:{base}" in shown
        assert "site-b exited with code 3 before it was ready; joining again in 2s (attempt 2 of 5)" in shown
        assert "all nodes ready" in shown and "site-c" not in shown

        script.send_signal(signal.SIGINT)  # Ctrl-C: the script sends SIGTERM to every node and waits
        script.wait(timeout=STOP_TIMEOUT_S)
        with pytest.raises(ProcessLookupError):
            os.killpg(script.pid, 0)  # nothing of the script's session is left
        for name in ("site-a", "site-b"):
            assert "stopped cleanly" in (cluster_dir / f"{name}.log").read_text(), name
        assert "stopping 2 nodes (SIGTERM)" in output_path.read_text()
    finally:
        _stop_group(script)


def test_local_cluster_script_commands_are_valid_run_flags(tmp_path):
    environ = {"PATH": os.environ["PATH"], "CLUSTER_DIR": str(tmp_path), "BASE_PORT": "7401",
               "NODE_CMD": "diloco-node"}
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=environ,
                            capture_output=True, text=True, timeout=30, check=True)
    commands = [shlex.split(line) for line in result.stdout.splitlines() if line.strip()]
    assert len(commands) == 4
    (tmp_path / "secret").write_text("s3cr3t-value-that-is-long-enough\n")
    (tmp_path / "secret").chmod(0o600)
    listens = []
    for argv in commands:
        assert argv[:2] == ["diloco-node", "run"]
        code, out, err = config_show(argv[2:], {})
        assert code == 0, err
        listens.append(next(line.split()[1] for line in out.splitlines() if line.startswith("listen ")))
    assert listens == ["127.0.0.1:7401", "127.0.0.1:7402", "127.0.0.1:7403", "127.0.0.1:7404"]
    assert "--bootstrap" not in commands[0] and all("127.0.0.1:7401" in c for c in commands[1:])
    assert not (tmp_path / "site-a").exists()  # a dry run creates nothing
