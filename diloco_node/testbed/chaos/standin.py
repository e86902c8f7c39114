"""A stand-in node process for exercising the chaos engine without the real daemon.

It is NOT a distributed protocol: the "replicated log" and the "lease" are files in a shared
directory guarded by `flock`, so it is correct by construction. What it does give the engine is a
real process that the supervisor can kill, stop, slow and restart, and that writes a history in
the contract format (docs/CHAOS.md): start, lease_acquired/lease_lost with epochs, append and
commit (by the lease holder, naming the learners that contributed), apply with a hash-chained
state digest, learner step progress, and a restart that replays from a checkpoint. A learner in
synchronous mode (min_quorum = every learner) waits, unproductive, while any learner is missing,
which is what makes the stand-in's goodput comparison meaningful.

    python -m diloco_node.testbed.chaos.standin --node-id n1 --data-dir D --cluster-dir C --lease-s 1
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from diloco_node.ops.history import HISTORY_FILE_NAME, HistoryWriter

TICK_S = 0.05  # one loop turn: a "learner step" and a look at the lease and the log
# A learner counts as present while its heartbeat file is younger than this.
PRESENCE_S = 0.5


def _read_json(path: Path, default: dict) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return dict(default)


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


class StandinNode:
    def __init__(self, args: argparse.Namespace) -> None:
        self.node = args.node_id
        self.data = Path(args.data_dir)
        self.cluster = Path(args.cluster_dir)
        self.lease_s = args.lease_s
        self.commit_interval_s = args.commit_interval_s
        self.min_quorum = args.min_quorum
        self.learner = args.role == "learner"
        self.data.mkdir(parents=True, exist_ok=True)
        (self.cluster / "alive").mkdir(parents=True, exist_ok=True)
        self.checkpoint_path = self.data / "checkpoint.json"
        cp = _read_json(self.checkpoint_path, {"applied": 0, "digest": "", "epoch": 0})
        self.applied: int = cp["applied"]
        self.digest: str = cp["digest"]
        self.epoch: int = cp["epoch"]
        self.holding = False
        self.last_commit = 0.0
        self.last_checkpoint = time.monotonic()
        self.history = HistoryWriter(self.data / HISTORY_FILE_NAME, self.node)
        self.running = True
        self.pending: list[tuple[str, dict]] = []

    def save_checkpoint(self) -> None:
        _write_json(self.checkpoint_path, {"applied": self.applied, "digest": self.digest, "epoch": self.epoch})
        self.last_checkpoint = time.monotonic()

    def run(self) -> None:
        time.sleep(0.3)  # a little boot time, like a daemon compiling its step
        self.history.record("start", epoch=self.epoch, index=self.applied, detail={"pid": os.getpid()})
        while self.running:
            began = time.monotonic()
            if self.learner:
                _write_json(self.cluster / "alive" / f"{self.node}.json", {"t": began})
            self.coordinate(began)
            self.apply_new()
            if time.monotonic() - self.last_checkpoint > 1.0:
                self.save_checkpoint()
            time.sleep(TICK_S)
            if self.learner:
                # Synchronous mode: the learner waits at the barrier while any learner is missing.
                waiting = len(self.present_learners(time.monotonic())) < self.min_quorum
                self.history.step(1, 128, 0.0 if waiting else time.monotonic() - began, learner_step=0)
        self.save_checkpoint()
        self.history.record("stop", epoch=self.epoch, index=self.applied)
        self.history.close()

    def present_learners(self, now: float) -> list[str]:
        present = []
        for path in (self.cluster / "alive").glob("*.json"):
            if now - _read_json(path, {"t": 0.0})["t"] < PRESENCE_S:
                present.append(path.stem)
        return sorted(present)

    def coordinate(self, now: float) -> None:
        """One look at the lease and, as holder, maybe a commit. History events are written after
        the lock is released, so a SIGSTOP is unlikely to freeze the holder inside it."""
        self.pending = []
        self._coordinate_locked(now)
        for kind, fields in self.pending:
            self.history.record(kind, **fields)

    def _coordinate_locked(self, now: float) -> None:
        with open(self.cluster / "lock", "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # someone holds it (maybe frozen by SIGSTOP): try next tick
            lease_path = self.cluster / "lease.json"
            lease = _read_json(lease_path, {"epoch": 0, "holder": None, "expires": 0.0})
            mine = lease["holder"] == self.node and lease["epoch"] == self.epoch
            if self.holding and not mine:
                self.holding = False
                self.epoch = max(self.epoch, lease["epoch"])
                self.save_checkpoint()
                self.pending.append(("lease_lost", {"epoch": self.epoch, "detail": {"holder": lease["holder"]}}))
            if mine and self.holding:
                lease["expires"] = now + self.lease_s
                _write_json(lease_path, lease)
            elif now > lease["expires"]:
                self.epoch = max(self.epoch, lease["epoch"]) + 1
                self.save_checkpoint()  # an epoch is durable before it is used
                _write_json(lease_path, {"epoch": self.epoch, "holder": self.node, "expires": now + self.lease_s})
                self.holding = True
                self.pending.append(("lease_acquired", {"epoch": self.epoch, "index": self.log_length()}))
                self.last_commit = now
            elif lease["epoch"] > self.epoch:
                self.epoch = lease["epoch"]
                self.save_checkpoint()
            if self.holding and now - self.last_commit >= self.commit_interval_s:
                contributors = self.present_learners(now)
                if len(contributors) >= self.min_quorum:
                    self.commit(contributors)
                    self.last_commit = now

    def log_length(self) -> int:
        path = self.cluster / "log.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def commit(self, contributors: list[str]) -> None:
        index = self.log_length() + 1
        entry = hashlib.blake2b(f"{self.epoch}|{index}|{','.join(contributors)}".encode(), digest_size=8).hexdigest()
        with open(self.cluster / "log.jsonl", "a") as log:
            log.write(json.dumps({"index": index, "epoch": self.epoch, "entry": entry}) + "\n")
        self.pending.append(("append", {"epoch": self.epoch, "index": index, "entry_digest": entry}))
        self.pending.append(("commit", {"epoch": self.epoch, "index": index, "entry_digest": entry,
                                        "detail": {"contributors": contributors}}))

    def apply_new(self) -> None:
        path = self.cluster / "log.jsonl"
        if not path.exists():
            return
        for line in path.read_text().splitlines()[self.applied:]:
            if not line.endswith("}"):
                break  # the holder is mid-write
            entry = json.loads(line)
            self.digest = hashlib.blake2b((self.digest + entry["entry"]).encode(), digest_size=8).hexdigest()
            self.applied = entry["index"]
            self.history.record("apply", epoch=self.epoch, index=self.applied, entry_digest=entry["entry"],
                                state_digest=self.digest, detail={"finite": True})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diloco_node.testbed.chaos.standin", description=__doc__.splitlines()[0])
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--cluster-dir", required=True)
    parser.add_argument("--lease-s", type=float, default=1.0)
    parser.add_argument("--commit-interval-s", type=float, default=0.25)
    parser.add_argument("--min-quorum", type=int, default=1)
    parser.add_argument("--role", choices=("learner", "witness"), default="learner")
    node = StandinNode(parser.parse_args(argv))

    def stop(*_: object) -> None:
        node.running = False

    signal.signal(signal.SIGTERM, stop)
    with contextlib.suppress(KeyboardInterrupt):
        node.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
