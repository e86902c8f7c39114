"""The one way to start a real node locally: for integration tests, the demo, chaos and benchmarks.

A `SiteSpec` says everything about one `python -m diloco_node run ...` process: its port, data
directory, log, run secret, optional config file, settings, role, bootstrap peer, the address it
advertises, the loopback address it sends from, an optional emulated WAN link in front of it, and
environment on top of `node_env()`. `Site` starts it (and its link) and answers `/status`; every
process is a `ChildProcess`: its own session and process group, output appended to its log,
signals to the whole group, and `kill`/`terminate` that always reap. `Site` is a context manager
and `close()` leaves nothing running.

Children get one XLA/OpenMP thread each and a shared persistent JAX compilation cache, so several
nodes fit on two cores and a restarted node compiles nothing; learner steps are paced
(`DILOCO_X_MIN_STEP_S`) so the learners leave the event loops CPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

REPO = Path(__file__).resolve().parents[2]  # the checkout: children import this very tree
# Small and fast: two fragments, a sync slot every 4 steps, tiny batches, a checkpoint every 3 s,
# the global model evaluated every 10 commits on 2 batches.
DEFAULT_SETTINGS = (
    "run.model.size=tiny", "run.model.seq_len=32", "run.inner.batch_size=4",
    "run.sync.fragments=2", "run.sync.period=8", "checkpoint_interval_s=3",
    "eval_interval_commits=10", "eval_batches=2",
)
JAX_CACHE = os.environ.get("DILOCO_X_TEST_JAX_CACHE", "/tmp/diloco-node-test-jax-cache")
# One thread per JAX process (several share two cores), the persistent compilation cache, CPU only.
THREAD_LIMITS = {
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
    "JAX_PLATFORMS": "cpu",
    "OMP_NUM_THREADS": "1",
    "JAX_COMPILATION_CACHE_DIR": JAX_CACHE,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
}
DEFAULT_MIN_STEP_S = "0.05"
# SIGKILL cannot be ignored; a child still unreaped after this means a stuck kernel, not a slow child.
REAP_TIMEOUT_S = 30.0
LINK_LISTEN_TIMEOUT_S = 20.0


class LaunchError(RuntimeError):
    """A process could not be started or reaped, or an emulated link never listened."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_secret(path: Path) -> Path:
    """A fresh run secret at `path`, readable by its owner only (the daemon refuses anything else)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(0o600)
    return path


def node_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: ours without DILOCO_* settings (they would reconfigure every
    node) but with DILOCO_X_* tooling knobs, plus `THREAD_LIMITS`, step pacing, this repository
    on the path, then `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_") or k.startswith("DILOCO_X_")}
    env.update(THREAD_LIMITS)
    env.setdefault("DILOCO_X_MIN_STEP_S", DEFAULT_MIN_STEP_S)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


# ---------------------------------------------------------------------------------------------
# One child process


class ChildProcess:
    """A child in its own session: it leads its own process group and every signal goes to the
    whole group, so helpers it spawned share its fate. Start it again after it exited to restart."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None,
                 cwd: Path | None = REPO) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = None if env is None else dict(env)
        self.cwd = cwd
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def pid(self) -> int | None:
        """The pid while the process is unreaped (after that the number may belong to another)."""
        return self.popen.pid if self.running else None  # type: ignore[union-attr]

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def start(self) -> int:
        if self.running:
            raise LaunchError(f"{self.name} is already running (pid {self.pid})")
        self.starts += 1
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # Readers split a log on this banner to look at the last start only.
            log.write(f"\n===== start {self.starts} of {self.name} at {time.strftime('%H:%M:%S')}: "
                      f"{' '.join(self.argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=self.env, cwd=self.cwd, start_new_session=True)
        return self.popen.pid

    def signal(self, sig: int) -> None:
        """Signal the group, only while its leader is unreaped: a reaped pid may be reused."""
        if self.running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, sig)  # type: ignore[union-attr]  # pgid == pid

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if it is still running after `timeout` (or never started)."""
        if self.popen is None:
            return None
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the group, leftovers of an exited leader included, and reap it."""
        if self.popen is None:
            return
        # Members still alive keep the group id reserved, so this reaches only our leftovers.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        try:
            self.popen.wait(REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise LaunchError(f"{self.name} (pid {self.popen.pid}) did not die after SIGKILL") from None

    def send_terminate(self) -> None:
        """SIGTERM, and SIGCONT so that a stopped process can act on it."""
        self.signal(signal.SIGTERM)
        self.signal(signal.SIGCONT)

    def terminate(self, grace_s: float) -> int | None:
        """SIGTERM, up to `grace_s` to exit, then SIGKILL; reaps and returns the exit code."""
        self.send_terminate()
        self.wait(grace_s)
        self.kill()
        return self.returncode


# ---------------------------------------------------------------------------------------------
# One node


@dataclass(frozen=True, slots=True)
class LinkShape:
    """An emulated WAN link in front of a node (`diloco-node linkemu`)."""

    bandwidth_mbit: float | None = None
    latency_ms: float = 0.0
    port: int = field(default_factory=free_port)  # where peers connect; it forwards to the node's port


@dataclass(frozen=True, slots=True)
class SiteSpec:
    node_id: str
    data_dir: Path
    log_path: Path
    secret_file: Path
    port: int = field(default_factory=free_port)  # the node listens here; /status is read here directly
    settings: Sequence[str] = DEFAULT_SETTINGS  # KEY=VALUE, each a `--set`; later ones win
    config_file: Path | None = None
    role: str | None = None  # None: the daemon's default (learner)
    bootstrap: str | None = None  # HOST:PORT of a member to join through; None founds a run
    advertise: str | None = None  # HOST:PORT peers use when it is neither the port nor `link`
    source_address: str | None = None  # loopback IP its outbound connections come from (partitions)
    link: LinkShape | None = None
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)  # on top of node_env()
    # Mutual TLS: a directory with site.crt, site.key and ca.crt (diloco_node/ops/pki.py makes
    # it). The peer port then speaks TLS only and the operator routes move to `status_port`.
    tls_dir: Path | None = None
    status_port: int = field(default_factory=free_port)  # used only with tls_dir

    @property
    def url(self) -> str:
        """Direct URL of the operator routes, never through an emulated link."""
        return f"http://127.0.0.1:{self.status_port if self.tls_dir is not None else self.port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls_dir is not None else "http"

    @property
    def address(self) -> str:
        """HOST:PORT peers use: what the node advertises and others bootstrap from."""
        if self.advertise is not None:
            return self.advertise
        return f"127.0.0.1:{self.link.port if self.link is not None else self.port}"

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "diloco_node", "run"]
        if self.config_file is not None:
            argv += ["--config", str(self.config_file)]
        argv += ["--node-id", self.node_id, "--listen", f"127.0.0.1:{self.port}", "--data-dir", str(self.data_dir),
                 "--secret-file", str(self.secret_file)]
        if self.address != f"127.0.0.1:{self.port}":
            argv += ["--advertise", f"{self.scheme}://{self.address}"]
        if self.tls_dir is not None:
            argv += ["--set", f"tls_cert_file={self.tls_dir / 'site.crt'}",
                     "--set", f"tls_key_file={self.tls_dir / 'site.key'}",
                     "--set", f"tls_ca_file={self.tls_dir / 'ca.crt'}",
                     "--set", f"status_listen=127.0.0.1:{self.status_port}"]
        if self.role is not None:
            argv += ["--role", self.role]
        if self.source_address is not None:
            argv += ["--source-address", self.source_address]
        for setting in self.settings:
            argv += ["--set", setting]
        if self.bootstrap is not None:
            argv += ["--bootstrap", self.bootstrap]
        return argv + list(self.extra_args)

    def child_env(self) -> dict[str, str]:
        return node_env(self.env)


def _link_argv(shape: LinkShape, upstream_port: int) -> list[str]:
    argv = [sys.executable, "-m", "diloco_node", "linkemu", "--listen", f"127.0.0.1:{shape.port}",
            "--upstream", f"127.0.0.1:{upstream_port}", "--latency-ms", str(shape.latency_ms)]
    if shape.bandwidth_mbit is not None:
        argv += ["--bandwidth-mbit", str(shape.bandwidth_mbit)]
    return argv


def start_link(shape: LinkShape, upstream_port: int, log_path: Path) -> ChildProcess:
    """An emulated link process forwarding `shape.port` to `upstream_port`, listening when this returns."""
    link = ChildProcess(f"link:{shape.port}", _link_argv(shape, upstream_port), log_path, node_env())
    link.start()
    deadline = time.monotonic() + LINK_LISTEN_TIMEOUT_S
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", shape.port)) == 0:
                return link
        if not link.running or time.monotonic() > deadline:
            link.kill()
            raise LaunchError(f"link emulator on port {shape.port} not listening (log {log_path})")
        time.sleep(0.05)


class Site:
    """One node process (and its link, if the spec has one). `start()` again restarts the node
    with the same spec; the link keeps running across restarts, as a real one would."""

    def __init__(self, spec: SiteSpec) -> None:
        self.spec = spec
        self.process = ChildProcess(spec.node_id, spec.argv(), spec.log_path, spec.child_env())
        self.link: ChildProcess | None = None

    @property
    def node_id(self) -> str:
        return self.spec.node_id

    @property
    def data_dir(self) -> Path:
        return self.spec.data_dir

    @property
    def log_path(self) -> Path:
        return self.spec.log_path

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def address(self) -> str:
        return self.spec.address

    @property
    def running(self) -> bool:
        return self.process.running

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def start(self) -> Site:
        shape = self.spec.link
        if shape is not None and (self.link is None or not self.link.running):
            self.link = start_link(shape, self.spec.port, self.spec.log_path.with_suffix(".link.log"))
        self.process.start()
        return self

    def signal(self, sig: int) -> None:
        self.process.signal(sig)

    def wait(self, timeout: float) -> int | None:
        return self.process.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the node (not its link) and reap it."""
        self.process.kill()

    def status(self, timeout: float = 2.0) -> dict[str, Any] | None:
        """The node's `/status` document, or None while it does not answer."""
        try:
            with urllib.request.urlopen(self.url + "/status", timeout=timeout) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def close(self) -> None:
        """SIGKILL the node and its link and reap both, whatever state they are in."""
        try:
            self.process.kill()
        finally:
            if self.link is not None:
                self.link.kill()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launch_site(spec: SiteSpec) -> Site:
    """Start the node of `spec` (its link first); use the result as a context manager."""
    site = Site(spec)
    try:
        return site.start()
    except BaseException:
        site.close()
        raise


def run_until_checkpointed(spec: SiteSpec, timeout_s: float) -> None:
    """Run the node of `spec` until it is ready and has written a checkpoint, then stop it with
    SIGTERM (a data directory to restart from); LaunchError with its log's tail otherwise."""
    with launch_site(spec) as site:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = site.status()
            if status and status.get("ready") and any((spec.data_dir / "checkpoints").glob("ckpt-*.bin")):
                break
            if not site.running:
                raise LaunchError(f"{spec.node_id} exited before its first checkpoint:\n{site.log_text()[-3000:]}")
            time.sleep(0.5)
        else:
            raise LaunchError(f"{spec.node_id} never became ready with a checkpoint:\n{site.log_text()[-3000:]}")
        site.signal(signal.SIGTERM)
        if site.wait(60) != 0:
            raise LaunchError(f"{spec.node_id} did not stop cleanly:\n{site.log_text()[-3000:]}")


__all__ = [
    "DEFAULT_SETTINGS", "REPO", "ChildProcess", "LaunchError", "LinkShape", "Site", "SiteSpec", "free_port",
    "launch_site", "node_env", "run_until_checkpointed", "start_link", "write_secret",
]
