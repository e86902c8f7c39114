"""Process lifecycle for chaos runs: start, SIGKILL, SIGSTOP/SIGCONT, restart, slow down, and
always reap.

Every child is a `testbed.launcher.ChildProcess`: its own session, so it leads its own process
group and each signal goes to the whole group (a daemon's helper processes die with it). What the
supervisor adds is processes by name, SIGSTOP that a slow-down cycle respects, restart from the
same spec, and closing all at once. `Supervisor` is a context manager:
leaving it, normally or by an exception or KeyboardInterrupt, continues stopped groups, sends
SIGTERM, waits a grace period, SIGKILLs what is left and reaps every child. No process it
started outlives it.

"Slow to a fraction of its speed" is a duty cycle: a thread stops and continues the group so it
runs `fraction` of every `SLOW_PERIOD_S`. The period is far below any lease or heartbeat time,
so peers see a slow node, not a dead one.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from diloco_node.testbed.launcher import ChildProcess, LaunchError

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
    process: ChildProcess
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
            self._signal_unless_stopped(signal.SIGSTOP)
            if self.done.wait(self.period_s * (1 - self.fraction)):
                break
            self._signal_unless_stopped(signal.SIGCONT)
            self.done.wait(self.period_s * self.fraction)
        self._signal_unless_stopped(signal.SIGCONT)

    def _signal_unless_stopped(self, sig: signal.Signals) -> None:
        with self.managed.lock:
            if not self.managed.stopped:
                self.managed.process.signal(sig)


class Supervisor:
    """Owns child processes (`launcher.ChildProcess`) by name. Use as a context manager, or call `close()`."""

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
        return managed is not None and managed.process.running

    def stopped(self, name: str) -> bool:
        managed = self._procs.get(name)
        return managed is not None and managed.stopped and managed.process.running

    def pid(self, name: str) -> int | None:
        managed = self._procs.get(name)
        return None if managed is None else managed.process.pid

    def returncode(self, name: str) -> int | None:
        managed = self._procs.get(name)
        return None if managed is None else managed.process.returncode

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self, spec: ProcessSpec) -> int:
        """Start `spec` (a name not running now); output is appended to `spec.log_path`."""
        if self.alive(spec.name):
            raise SupervisorError(f"{spec.name} is already running (pid {self.pid(spec.name)})")
        old = self._procs.pop(spec.name, None)
        if old is not None:
            self._reap(old)
        process = ChildProcess(spec.name, spec.argv, spec.log_path, spec.env, spec.cwd)
        pid = process.start()
        self._procs[spec.name] = _Managed(spec, process)
        self._specs[spec.name] = spec
        self.started_pids.append(pid)
        return pid

    def kill(self, name: str) -> None:
        """SIGKILL the process group and reap it (a no-op on a process that already exited)."""
        managed = self._get(name)
        self._end_throttle(managed)
        with managed.lock:
            managed.stopped = False
        self._reap(managed)

    def stop(self, name: str) -> None:
        """SIGSTOP the group: the process is frozen, sockets stay open, timers stop."""
        managed = self._running(name)
        with managed.lock:
            managed.stopped = True
            managed.process.signal(signal.SIGSTOP)

    def cont(self, name: str) -> None:
        """SIGCONT after `stop` (a slowed process goes back to its duty cycle)."""
        managed = self._running(name)
        with managed.lock:
            managed.stopped = False
            managed.process.signal(signal.SIGCONT)

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
        with managed.lock:
            managed.stopped = False
            managed.process.send_terminate()
        managed.process.wait(self.terminate_grace_s if grace_s is None else grace_s)
        self._reap(managed)
        return managed.process.returncode

    def close(self) -> None:
        """Terminate every process (all at once, then wait); SIGKILL stragglers; reap all."""
        for managed in self._procs.values():
            self._end_throttle(managed)
        running = [m for m in self._procs.values() if m.process.running]
        for managed in running:
            managed.process.send_terminate()
        deadline = time.monotonic() + self.terminate_grace_s
        for managed in running:
            managed.process.wait(max(0.0, deadline - time.monotonic()))
        for managed in running:
            self._reap(managed)

    def __enter__(self) -> Self:
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
        if not managed.process.running:
            raise SupervisorError(f"{name} is not running (exit code {managed.process.returncode})")
        return managed

    @staticmethod
    def _end_throttle(managed: _Managed) -> None:
        if managed.throttle is not None:
            managed.throttle.done.set()
            managed.throttle.join()
            managed.throttle = None

    @staticmethod
    def _reap(managed: _Managed) -> None:
        """SIGKILL whatever is left of the group and reap its leader."""
        try:
            managed.process.kill()
        except LaunchError as exc:
            raise SupervisorError(str(exc)) from None
