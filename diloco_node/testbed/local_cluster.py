"""A local cluster of real `diloco-node run` processes on 127.0.0.1 (integration tests, the demo, benchmarks).

Each site is a subprocess (`sys.executable -m diloco_node run ...`) with a free port, its own data
directory and log file. JAX in the children is kept to one thread and a shared persistent
compilation cache, so several nodes fit on two cores. `Cluster.close()` kills every process it
started (SIGKILL, then waits), whatever state the test left them in.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]  # the checkout: children import this very tree
# Small and fast: two fragments, a sync slot every 4 steps, tiny batches. Steps are paced so a
# few JAX processes share two cores without starving the event loops.
DEFAULT_RUN_FLAGS = (
    "--set", "run.model.size=tiny", "--set", "run.model.seq_len=32", "--set", "run.inner.batch_size=4",
    "--set", "run.sync.fragments=2", "--set", "run.sync.period=8",
    "--set", "checkpoint_interval_s=3",
)
JAX_CACHE = os.environ.get("DILOCO_X_TEST_JAX_CACHE", "/tmp/diloco-node-test-jax-cache")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env.update({
        "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": JAX_CACHE,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "OMP_NUM_THREADS": "1",
        "DILOCO_X_MIN_STEP_S": "0.05",
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    })
    env.update(extra or {})
    return env


@dataclass
class Site:
    node_id: str
    port: int
    data_dir: Path
    log_path: Path
    args: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    public_port: int | None = None  # where peers reach it (a link emulator in front), if not `port`

    @property
    def url(self) -> str:
        """Direct URL (operator routes are read here, not through an emulated link)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        """HOST:PORT peers use (bootstrap address)."""
        return f"127.0.0.1:{self.public_port or self.port}"

    def start(self) -> None:
        self.starts += 1
        log = open(self.log_path, "ab")
        log.write(f"\n===== start {self.starts} =====\n".encode())
        log.flush()
        self.proc = subprocess.Popen([sys.executable, "-m", "diloco_node", "run", *self.args], stdout=log,
                                     stderr=subprocess.STDOUT, env=self.env, cwd=REPO)
        log.close()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait(10)

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self, timeout: float = 2.0) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(self.url + "/status", timeout=timeout) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class Cluster:
    root: Path
    secret_file: Path
    sites: dict[str, Site] = field(default_factory=dict)
    # Every (commit_index -> state_digest) any site ever reported: one digest per index, ever.
    history: dict[int, set[str]] = field(default_factory=dict)  # commit index -> digests reported there
    reporters: dict[int, set[str]] = field(default_factory=dict)  # commit index -> sites that reported it

    @classmethod
    def create(cls, root: Path) -> Cluster:
        root.mkdir(parents=True, exist_ok=True)
        secret = root / "secret"
        secret.write_bytes(os.urandom(48).hex().encode())
        secret.chmod(0o600)
        return cls(root, secret)

    def add(self, node_id: str, *, bootstrap: Site | None = None, extra: Sequence[str] = (),
            secret_file: Path | None = None, env: dict[str, str] | None = None, start: bool = True,
            port: int | None = None, public_port: int | None = None,
            run_flags: Sequence[str] = DEFAULT_RUN_FLAGS) -> Site:
        port = port or free_port()
        data_dir = self.root / node_id
        args = ["--node-id", node_id, "--listen", f"127.0.0.1:{port}", "--data-dir", str(data_dir),
                "--secret-file", str(secret_file or self.secret_file), *run_flags, *extra]
        if public_port is not None:
            args += ["--advertise", f"http://127.0.0.1:{public_port}"]
        if bootstrap is not None:
            args += ["--bootstrap", bootstrap.address]
        site = Site(node_id, port, data_dir, self.root / f"{node_id}.log", args, child_env(env),
                    public_port=public_port)
        self.sites[node_id] = site
        if start:
            site.start()
        return site

    def close(self) -> None:
        for site in self.sites.values():
            if site.proc is not None and site.proc.poll() is None:
                site.proc.kill()
        for site in self.sites.values():
            if site.proc is not None:
                try:
                    site.proc.wait(15)
                except subprocess.TimeoutExpired:
                    pass

    # ---- observation ----------------------------------------------------------------------

    def poll(self) -> dict[str, dict[str, Any]]:
        """Current status of every running site; records (index, digest) pairs in `history`."""
        out = {}
        for node_id, site in self.sites.items():
            if not site.running:
                continue
            doc = site.status()
            if doc is None:
                continue
            out[node_id] = doc
            if doc.get("ready"):
                self.history.setdefault(doc["commit_index"], set()).add(doc["state_digest"])
                self.reporters.setdefault(doc["commit_index"], set()).add(node_id)
        return out

    def wait_for(self, what: str, check: Callable[[dict[str, dict[str, Any]]], bool], timeout: float,
                 interval: float = 0.3) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        last: dict[str, dict[str, Any]] = {}
        while time.monotonic() < deadline:
            last = self.poll()
            if check(last):
                return last
            time.sleep(interval)
        brief = {n: (d.get("ready"), d.get("coordinator"), d.get("commit_index"), d.get("ready_reason"))
                 for n, d in last.items()}
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last statuses: {brief}")

    def common_commit_index(self, names: set[str], timeout: float) -> int:
        """Poll until one commit index has been reported (ready) by every site in `names`; the
        highest such index. Digests at it are recorded in `history` as for every poll."""
        seen: dict[str, set[int]] = {n: set() for n in names}

        def check(statuses: dict[str, dict[str, Any]]) -> bool:
            for n in names:
                if n in statuses and statuses[n].get("ready"):
                    seen[n].add(statuses[n]["commit_index"])
            return bool(set.intersection(*seen.values()))

        self.wait_for(f"one commit index reported by all of {sorted(names)}", check, timeout, interval=0.05)
        return max(set.intersection(*seen.values()))

    def conflicting_indices(self) -> dict[int, set[str]]:
        return {index: digests for index, digests in self.history.items() if len(digests) > 1}

    def shared_indices(self) -> int:
        """How many commit indices at least two sites reported: what the digest check compared."""
        return sum(1 for nodes in self.reporters.values() if len(nodes) > 1)

    def coordinator(self, statuses: dict[str, dict[str, Any]]) -> str | None:
        holders = {d.get("coordinator") for d in statuses.values() if d.get("coordinator")}
        return holders.pop() if len(holders) == 1 else None
