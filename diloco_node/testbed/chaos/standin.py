"""A stand-in node process for exercising the chaos engine without the real daemon.

It is NOT a distributed protocol: the "replicated log" and the "lease" are files in a shared
directory guarded by `flock`, so it is correct by construction. What it does give the engine is a
real process that the supervisor can kill, stop, slow and restart, and that writes a history in
the contract format (docs/CHAOS.md): start, lease_acquired/lease_lost with epochs, append and
commit (by the lease holder, naming the learners that contributed), apply with a hash-chained
state digest, learner step progress, and a restart that replays from a checkpoint. A learner in
synchronous mode (min_quorum = every learner) waits, unproductive, while any learner is missing,
which is what makes the stand-in's goodput comparison meaningful.

It models the storage and clock faults too, with the daemon's failpoints (storage/failpoints.py)
armed from `DILOCO_X_FAILPOINTS` and, at run time, from `<data_dir>/failpoints.spec`: its own durable
state (checkpoint.json: applied index, digest, epoch, with a CRC) is written behind
`checkpoint.write` and its commits appended to the shared log behind `log.append`, each fsynced,
and a crash at a fsync drops what was not synced. It never uses an epoch it could not persist,
gives up the lease when it cannot append, quarantines a corrupt checkpoint and recovers the epoch
from the cluster's lease file. `<data_dir>/clock.json` skews its wall clock (history `t_wall` only).
`--record-before-fsync` plants a bug for the checker to catch: the holder records its commit before
the line is durable, so a crash at that fsync loses an entry it claimed.

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
import zlib
from pathlib import Path

from diloco_node.clock import SystemClock, set_wall_skew
from diloco_node.ops.history import HISTORY_FILE_NAME, HistoryWriter
from diloco_node.storage import durable, failpoints

TICK_S = 0.05  # one loop turn: a "learner step" and a look at the lease and the log
# A learner counts as present while its heartbeat file is younger than this.
PRESENCE_S = 0.5
FAILPOINTS_FILE = "failpoints.spec"
CLOCK_FILE = "clock.json"


def _read_json(path: Path, default: dict) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return dict(default)


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _write_checkpoint(path: Path, value: dict) -> None:
    """checkpoint.json with a CRC over its body, through the `checkpoint.write` failpoint: written
    to a temporary file, fsynced, renamed (a crash at the fsync leaves the previous one)."""
    body = json.dumps(value, sort_keys=True)
    durable.atomic_write("checkpoint.write", path, json.dumps({"crc": zlib.crc32(body.encode()), "body": body}).encode())


def _read_checkpoint(path: Path) -> dict | None:
    """The checkpoint's fields, None when there is none; ValueError when it is damaged."""
    failpoints.hit("checkpoint.read")
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    if not isinstance(raw, dict) or zlib.crc32(str(raw.get("body")).encode()) != raw.get("crc"):
        raise ValueError(f"{path}: checksum mismatch")
    return json.loads(raw["body"])


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
        self.record_before_fsync = args.record_before_fsync
        self.checkpoint_path = self.data / "checkpoint.json"
        self._failpoints_text = ""
        self._clock_text = ""
        failpoints.load_from_env()
        failpoints.on_crash(self._before_crash)
        self.poll_fault_files()
        self.recovered_from = ""
        try:
            cp = _read_checkpoint(self.checkpoint_path)
        except ValueError as exc:
            # Corrupt at rest: keep it aside, replay the log from the start, and take the epoch
            # from the cluster (every epoch a node used is in the lease file or below it).
            quarantine = self.checkpoint_path.with_name(f"checkpoint.json.corrupt-{os.getpid()}")
            os.replace(self.checkpoint_path, quarantine)
            lease = _read_json(self.cluster / "lease.json", {"epoch": 0})
            cp = {"applied": 0, "digest": "", "epoch": lease["epoch"]}
            self.recovered_from = f"{exc}; quarantined as {quarantine.name}, epoch {lease['epoch']} from the lease file"
            print(f"{self.node}: {self.recovered_from}", file=sys.stderr, flush=True)
        cp = cp or {"applied": 0, "digest": "", "epoch": 0}
        self.applied: int = cp["applied"]
        self.digest: str = cp["digest"]
        self.epoch: int = cp["epoch"]
        self.holding = False
        self.last_commit = 0.0
        self.last_checkpoint = time.monotonic()
        self.history = HistoryWriter(self.data / HISTORY_FILE_NAME, self.node, wall_clock=SystemClock().wall)
        self.running = True
        self.pending: list[tuple[str, dict]] = []

    def poll_fault_files(self) -> None:
        """The harness's run-time faults: failpoints to arm (all disarmed first) and a wall-clock skew."""
        text = _read_text(self.data / FAILPOINTS_FILE)
        if text != self._failpoints_text:
            self._failpoints_text = text
            failpoints.disarm()
            failpoints.arm(text)
        text = _read_text(self.data / CLOCK_FILE)
        if text != self._clock_text:
            self._clock_text = text
            skew = json.loads(text) if text else {}
            set_wall_skew(skew.get("offset_s", 0.0), skew.get("drift_rate", 0.0))

    def _before_crash(self) -> None:
        """The failpoints armed at run time die with the process, as a daemon's do (what was not
        fsynced is dropped by `durable`, which runs its own hook)."""
        (self.data / FAILPOINTS_FILE).unlink(missing_ok=True)

    def save_checkpoint(self, epoch: int | None = None) -> bool:
        """Persist applied index, digest and `epoch` (default: ours); False when the disk refused
        (the caller must then not use that epoch)."""
        try:
            _write_checkpoint(self.checkpoint_path, {"applied": self.applied, "digest": self.digest,
                                                     "epoch": self.epoch if epoch is None else epoch})
        except OSError as exc:
            print(f"{self.node}: checkpoint not written: {exc}", file=sys.stderr, flush=True)
            return False
        self.last_checkpoint = time.monotonic()
        return True

    def adopt_epoch(self, epoch: int) -> bool:
        """Use `epoch` from now on, once it is durable."""
        if epoch <= self.epoch:
            return True
        if not self.save_checkpoint(epoch):
            return False
        self.epoch = epoch
        return True

    def run(self) -> None:
        time.sleep(0.3)  # a little boot time, like a daemon compiling its step
        detail = {"pid": os.getpid(), **({"recovered": self.recovered_from} if self.recovered_from else {})}
        self.history.record("start", epoch=self.epoch, index=self.applied, detail=detail)
        while self.running:
            began = time.monotonic()
            self.poll_fault_files()
            if self.learner:
                _write_json(self.cluster / "alive" / f"{self.node}.json", {"t": began})
            self.coordinate(began)
            self.apply_new()
            if time.monotonic() - self.last_checkpoint > 1.0:
                self.save_checkpoint()  # a refusal is fine: a restart replays from an older one
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
                self.adopt_epoch(lease["epoch"])
                self.pending.append(("lease_lost", {"epoch": self.epoch, "detail": {"holder": lease["holder"]}}))
            if mine and self.holding:
                lease["expires"] = now + self.lease_s
                _write_json(lease_path, lease)
            elif now > lease["expires"]:
                # An epoch is durable before it is used: a node that cannot persist it stays out.
                if self.adopt_epoch(max(self.epoch, lease["epoch"]) + 1):
                    _write_json(lease_path, {"epoch": self.epoch, "holder": self.node, "expires": now + self.lease_s})
                    self.holding = True
                    self.pending.append(("lease_acquired", {"epoch": self.epoch, "index": self.log_length()}))
                    self.last_commit = now
            elif lease["epoch"] > self.epoch:
                self.adopt_epoch(lease["epoch"])
            if self.holding and now - self.last_commit >= self.commit_interval_s:
                contributors = self.present_learners(now)
                if len(contributors) >= self.min_quorum:
                    try:
                        self.commit(contributors)
                    except OSError as exc:
                        # It cannot persist its log: it gives the lease up rather than hold it idle.
                        self.holding = False
                        _write_json(lease_path, {**lease, "expires": 0.0})
                        self.pending.append(("lease_lost", {"epoch": self.epoch, "detail": {
                            "holder": None, "reason": f"cannot append to the log: {exc}"}}))
                    self.last_commit = now

    def log_length(self) -> int:
        path = self.cluster / "log.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def commit(self, contributors: list[str]) -> None:
        """Append one entry to the shared log, fsynced behind `log.append`, then record it."""
        index = self.log_length() + 1
        entry = hashlib.blake2b(f"{self.epoch}|{index}|{','.join(contributors)}".encode(), digest_size=8).hexdigest()
        events = [("append", {"epoch": self.epoch, "index": index, "entry_digest": entry}),
                  ("commit", {"epoch": self.epoch, "index": index, "entry_digest": entry,
                              "detail": {"contributors": contributors}})]
        if self.record_before_fsync:  # the planted bug: a claim made before the entry is durable
            for kind, fields in events:
                self.history.record(kind, **fields)
            events = []
        failpoints.hit("log.append")
        path = self.cluster / "log.jsonl"
        # Tracked only while this append is in flight: the file is shared, and what the others
        # appended (and fsynced, under the same lock) before now is durable. A crash at the fsync
        # cuts the file back to its length here, as a power cut would drop the unsynced line.
        durable.track(path)
        try:
            with open(path, "a") as log:
                log.write(json.dumps({"index": index, "epoch": self.epoch, "entry": entry}) + "\n")
                log.flush()
                durable.sync_file("log.append", log.fileno(), path)
        finally:
            durable.forget(path)
        self.pending += events

    def apply_new(self) -> None:
        path = self.cluster / "log.jsonl"
        if not path.exists():
            return
        # Read under a shared lock: a line being appended is not durable until the holder's fsync,
        # and a crash at that fsync takes it back, so nobody may apply it before then.
        with open(self.cluster / "lock", "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # the holder is appending (or frozen while it does): next tick
            lines = path.read_text().splitlines()[self.applied:]
        for line in lines:
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
    parser.add_argument("--record-before-fsync", action="store_true",
                        help="planted bug: record a commit before its log line is fsynced")
    node = StandinNode(parser.parse_args(argv))

    def stop(*_: object) -> None:
        node.running = False

    signal.signal(signal.SIGTERM, stop)
    with contextlib.suppress(KeyboardInterrupt):
        node.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
