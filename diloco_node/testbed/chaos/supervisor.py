"""Process lifecycle for chaos runs: start, SIGKILL, SIGSTOP/SIGCONT, restart, slow down, and
always reap.

Every child starts in its own session, so it leads its own process group and each signal goes to
the whole group (a daemon's helper processes die with it). `Supervisor` is a context manager:
leaving it, normally or by an exception or KeyboardInterrupt, continues stopped groups, sends
SIGTERM, waits a grace period, SIGKILLs what is left and reaps every child. No process it
started outlives it.

"Slow to a fraction of its speed" is a duty cycle: a thread stops and continues the group so it
runs `fraction` of every `SLOW_PERIOD_S`. The period is far below any lease or heartbeat time,
so peers see a slow node, not a dead one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# How long a child may take to exit after SIGTERM before it is SIGKILLed: a daemon flushes a
# checkpoint on SIGTERM, which takes well under this on the tiny models chaos runs use.
TERMINATE_GRACE_S = 10.0
# Duty-cycle period of a slowed process: short against heartbeats (>= 0.5 s) so it looks slow,
# long against the scheduler tick (~4 ms) so the fraction is honoured.
SLOW_PERIOD_S = 0.2


class SupervisorError(RuntimeError):
    """Misuse: an unknown name, starting a name twice, acting on a process that is not running."""


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] | None = None  # None: inherit ours
    cwd: Path | None = None


@dataclass(slots=True)
class _Managed:
    spec: ProcessSpec
    popen: subprocess.Popen[bytes]
    stopped: bool = False  # by stop(); the throttle must not continue it
    throttle: _Throttle | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Throttle(threading.Thread):
    """Runs a process group `fraction` of every `period_s` by SIGSTOP/SIGCONT."""

    def __init__(self, managed: _Managed, fraction: float, period_s: float) -> None:
        super().__init__(name=f"slow-{managed.spec.name}", daemon=True)
        self.managed = managed
        self.fraction = fraction
        self.period_s = period_s
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            with self.managed.lock:
                if not self.managed.stopped:
                    _signal_if_unreaped(self.managed.popen, signal.SIGSTOP)
            if self.done.wait(self.period_s * (1 - self.fraction)):
                break
            with self.managed.lock:
                if not self.managed.stopped:
                    _signal_if_unreaped(self.managed.popen, signal.SIGCONT)
            self.done.wait(self.period_s * self.fraction)
        with self.managed.lock:
            if not self.managed.stopped:
                _signal_if_unreaped(self.managed.popen, signal.SIGCONT)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)  # the child leads its own group: pgid == pid


def _signal_if_unreaped(popen: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the group only while its leader is unreaped: a reaped pid may be reused."""
    if popen.poll() is None:
        _signal_group(popen.pid, sig)


class Supervisor:
    """Owns child processes by name. Use as a context manager, or call `close()`."""

    def __init__(self, terminate_grace_s: float = TERMINATE_GRACE_S, slow_period_s: float = SLOW_PERIOD_S) -> None:
        self.terminate_grace_s = terminate_grace_s
        self.slow_period_s = slow_period_s
        self._procs: dict[str, _Managed] = {}
        self._specs: dict[str, ProcessSpec] = {}
        self.started_pids: list[int] = []  # every pid ever started, for "nothing left behind" checks

    # ---- queries ---------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._specs)

    def alive(self, name: str) -> bool:
        managed = self._procs.get(name)
        return managed is not None and managed.popen.poll() is None

    def stopped(self, name: str) -> bool:
        managed = self._procs.get(name)
        return managed is not None and managed.stopped and managed.popen.poll() is None

    def pid(self, name: str) -> int | None:
        managed = self._procs.get(name)
        return managed.popen.pid if managed is not None and managed.popen.poll() is None else None

    def returncode(self, name: str) -> int | None:
        managed = self._procs.get(name)
        return None if managed is None else managed.popen.poll()

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self, spec: ProcessSpec) -> int:
        """Start `spec` (a name not running now); output is appended to `spec.log_path`."""
        if self.alive(spec.name):
            raise SupervisorError(f"{spec.name} is already running (pid {self.pid(spec.name)})")
        old = self._procs.pop(spec.name, None)
        if old is not None:
            self._reap(old)
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log_path, "ab") as log:
            log.write(f"--- start {spec.name} at {time.strftime('%H:%M:%S')}: {' '.join(spec.argv)}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                list(spec.argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=None if spec.env is None else dict(spec.env), cwd=spec.cwd,
                start_new_session=True,  # own process group: signals reach its children too
            )
        self._procs[spec.name] = _Managed(spec, popen)
        self._specs[spec.name] = spec
        self.started_pids.append(popen.pid)
        return popen.pid

    def kill(self, name: str) -> None:
        """SIGKILL the process group and reap it (a no-op on a process that already exited)."""
        managed = self._get(name)
        self._end_throttle(managed)
        with managed.lock:
            _signal_if_unreaped(managed.popen, signal.SIGKILL)
            managed.stopped = False
        self._reap(managed)

    def stop(self, name: str) -> None:
        """SIGSTOP the group: the process is frozen, sockets stay open, timers stop."""
        managed = self._running(name)
        with managed.lock:
            managed.stopped = True
            _signal_group(managed.popen.pid, signal.SIGSTOP)

    def cont(self, name: str) -> None:
        """SIGCONT after `stop` (a slowed process goes back to its duty cycle)."""
        managed = self._running(name)
        with managed.lock:
            managed.stopped = False
            _signal_group(managed.popen.pid, signal.SIGCONT)

    def restart(self, name: str) -> int:
        """SIGKILL (if running) and start again with the same spec."""
        spec = self._specs.get(name)
        if spec is None:
            raise SupervisorError(f"unknown process {name!r}")
        if name in self._procs:
            self.kill(name)
        return self.start(spec)

    def slow(self, name: str, fraction: float) -> None:
        """Run the process at `fraction` of its speed until `unslow` (or kill/terminate)."""
        if not 0 < fraction < 1:
            raise SupervisorError(f"slow {name}: fraction must be in (0, 1), got {fraction}")
        managed = self._running(name)
        self._end_throttle(managed)
        managed.throttle = _Throttle(managed, fraction, self.slow_period_s)
        managed.throttle.start()

    def unslow(self, name: str) -> None:
        managed = self._procs.get(name)
        if managed is not None:
            self._end_throttle(managed)

    def terminate(self, name: str, grace_s: float | None = None) -> int | None:
        """SIGTERM, wait up to `grace_s`, then SIGKILL; reaps and returns the exit code."""
        managed = self._get(name)
        self._end_throttle(managed)
        if managed.popen.poll() is None:
            with managed.lock:
                managed.stopped = False
                _signal_group(managed.popen.pid, signal.SIGTERM)
                _signal_group(managed.popen.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            try:
                managed.popen.wait(self.terminate_grace_s if grace_s is None else grace_s)
            except subprocess.TimeoutExpired:
                _signal_if_unreaped(managed.popen, signal.SIGKILL)
        self._reap(managed)
        return managed.popen.returncode

    def close(self) -> None:
        """Terminate every process (all at once, then wait); SIGKILL stragglers; reap all."""
        managed_all = [m for m in self._procs.values() if m.popen.poll() is None]
        for managed in self._procs.values():
            self._end_throttle(managed)
        for managed in managed_all:
            self._end_throttle(managed)
            if managed.popen.poll() is None:
                _signal_group(managed.popen.pid, signal.SIGTERM)
                _signal_group(managed.popen.pid, signal.SIGCONT)
        deadline = time.monotonic() + self.terminate_grace_s
        for managed in managed_all:
            try:
                managed.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for managed in managed_all:
            # The group's other members keep its id reserved, so this reaches only leftovers.
            _signal_group(managed.popen.pid, signal.SIGKILL)
            self._reap(managed)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------------

    def _get(self, name: str) -> _Managed:
        managed = self._procs.get(name)
        if managed is None:
            raise SupervisorError(f"unknown process {name!r}")
        return managed

    def _running(self, name: str) -> _Managed:
        managed = self._get(name)
        if managed.popen.poll() is not None:
            raise SupervisorError(f"{name} is not running (exit code {managed.popen.returncode})")
        return managed

    @staticmethod
    def _end_throttle(managed: _Managed) -> None:
        if managed.throttle is not None:
            managed.throttle.done.set()
            managed.throttle.join()
            managed.throttle = None

    @staticmethod
    def _reap(managed: _Managed) -> None:
        # SIGKILL cannot be ignored; if wait still times out the kernel is stuck, and hanging
        # here forever would hide it.
        try:
            managed.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise SupervisorError(f"{managed.spec.name} (pid {managed.popen.pid}) did not die after SIGKILL") from None
