"""The history recorder: the line format, step batching, torn-tail handling, thread safety."""

from __future__ import annotations

import json
import threading

import pytest

from diloco_node.clock import FakeClock
from diloco_node.ops.history import (
    FIELDS,
    HistoryEvent,
    HistoryFormatError,
    HistoryWriter,
    MAX_LINE_BYTES,
    find_history_files,
    load_histories,
    read_history,
    rotated_path,
)


def test_round_trip_every_field(tmp_path):
    clock = FakeClock(100.0)
    path = tmp_path / "n1" / "history.jsonl"
    with HistoryWriter(path, "n1", wall_clock=lambda: 1.7e9, mono_clock=clock) as w:
        w.record("start", epoch=0, index=0)
        w.record("lease_acquired", epoch=3, index=7, detail={"votes": ["n1", "n2"]})
        w.record("commit", epoch=3, index=8, entry_digest="aa", fragment=2, round=5,
                 detail={"contributors": ["n1"]})
        w.record("apply", epoch=3, index=8, entry_digest="aa", state_digest="ss", detail={"finite": True})
    lines = path.read_text().splitlines()
    assert len(lines) == 4
    assert all(list(json.loads(line)) == list(FIELDS) for line in lines)
    history = read_history(path)
    assert not history.torn_tail
    assert [e.kind for e in history.events] == ["start", "lease_acquired", "commit", "apply"]
    commit = history.events[2]
    assert (commit.epoch, commit.index, commit.entry_digest, commit.fragment, commit.round) == (3, 8, "aa", 2, 5)
    assert commit.detail == {"contributors": ["n1"]}
    assert commit.t_mono == 100.0 and commit.t_wall == 1.7e9


def test_steps_are_batched_about_once_per_second(tmp_path):
    clock = FakeClock(100.0)
    path = tmp_path / "history.jsonl"
    w = HistoryWriter(path, "n1", mono_clock=clock, step_batch_s=1.0)
    for _ in range(11):  # 0.25 s apart: a batch closes at 1.0 s and at 2.25 s, one step pending
        w.step(1, 128, 0.2, learner_step=0)
        clock.now += 0.25
    w.record("commit", epoch=1, index=1, entry_digest="x")  # flushes pending progress first
    w.close()
    events = read_history(path).events
    steps = [e for e in events if e.kind == "step"]
    assert [e.detail["steps"] for e in steps] == [5, 5, 1]
    assert sum(e.detail["tokens"] for e in steps) == 11 * 128
    assert sum(e.detail["productive_s"] for e in steps) == pytest.approx(2.2)
    assert steps[0].detail["learner_step"] == 0
    assert events[-1].kind == "commit" and events[-2].kind == "step"


def test_torn_last_line_is_dropped_and_cut_on_reopen(tmp_path):
    path = tmp_path / "history.jsonl"
    with HistoryWriter(path, "n1") as w:
        w.record("start")
        w.record("commit", epoch=1, index=1, entry_digest="x")
    with open(path, "ab") as f:
        f.write(b'{"t_wall":1,"t_mono":2,"node":"n1","ki')  # SIGKILL mid-write
    history = read_history(path)
    assert history.torn_tail and len(history.events) == 2
    with HistoryWriter(path, "n1") as w:  # the restarted node appends cleanly
        w.record("start")
    history = read_history(path)
    assert not history.torn_tail
    assert [e.kind for e in history.events] == ["start", "commit", "start"]


def test_a_bad_line_in_the_middle_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "history.jsonl"
    with HistoryWriter(path, "n1") as w:
        w.record("start")
    with open(path, "ab") as f:
        f.write(b"not json\n")
    with HistoryWriter(path, "n1") as w:
        w.record("stop")
    with pytest.raises(HistoryFormatError, match=r"history.jsonl:2:"):
        read_history(path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kind": "explode"}, "kind"),
        ({"kind": "commit"}, "needs index and entry_digest"),
        ({"kind": "apply", "index": 1, "entry_digest": "x"}, "needs state_digest"),
        ({"kind": "vote"}, "needs epoch"),
        ({"kind": "step", "detail": {"steps": 1, "tokens": 2}}, "productive_s"),
        ({"index": -1}, "index"),
        ({"epoch": True}, "epoch"),
        ({"t_mono": float("nan")}, "t_mono"),
        ({"node": ""}, "node"),
    ],
)
def test_invalid_events_are_refused_with_the_field_named(changes, message):
    base = dict(t_wall=1.0, t_mono=1.0, node="n1", kind="start")
    with pytest.raises(HistoryFormatError, match=message):
        HistoryEvent(**{**base, **changes})


def test_unknown_and_missing_keys_are_refused(tmp_path):
    good = HistoryEvent(t_wall=1.0, t_mono=1.0, node="n1", kind="start").to_dict()
    with pytest.raises(HistoryFormatError, match="unknown keys extra"):
        HistoryEvent.from_dict({**good, "extra": 1})
    del good["round"]
    with pytest.raises(HistoryFormatError, match="missing round"):
        HistoryEvent.from_dict(good)


def test_concurrent_writers_never_interleave_lines(tmp_path):
    path = tmp_path / "history.jsonl"
    w = HistoryWriter(path, "n1", fsync="never")

    def hammer(thread: int) -> None:
        for i in range(200):
            w.record("append", epoch=1, index=i, entry_digest=f"{thread}-{i}" * 20)

    threads = [threading.Thread(target=hammer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    events = read_history(path).events
    assert len(events) == 800
    assert len({e.entry_digest for e in events}) == 800


def test_load_histories_groups_by_node_and_sorts_by_monotonic_time(tmp_path):
    clock = FakeClock(100.0)
    a = HistoryWriter(tmp_path / "a" / "history.jsonl", "a", mono_clock=clock)
    b = HistoryWriter(tmp_path / "b" / "history.jsonl", "b", mono_clock=clock)
    a.record("start")
    clock.now += 1
    b.record("start")
    clock.now += 1
    a.record("stop")
    a.close()
    b.close()
    histories = load_histories([tmp_path / "a" / "history.jsonl", tmp_path / "b" / "history.jsonl"])
    assert sorted(histories) == ["a", "b"]
    assert [e.kind for e in histories["a"]] == ["start", "stop"]
    assert [e.t_mono for e in histories["a"]] == [100.0, 102.0]


def test_writer_refuses_bad_policy_and_writes_after_close(tmp_path):
    with pytest.raises(ValueError, match="fsync"):
        HistoryWriter(tmp_path / "h.jsonl", "n1", fsync="sometimes")  # type: ignore[arg-type]
    w = HistoryWriter(tmp_path / "h.jsonl", "n1")
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.record("start")


def test_rotation_bounds_the_files_and_readers_see_every_kept_segment(tmp_path):
    clock = FakeClock(100.0)
    live = tmp_path / "node" / "history.jsonl"
    padding = "x" * 2000  # ~2.2 KB lines: a segment holds about 30 of them
    w = HistoryWriter(live, "n1", mono_clock=clock, max_bytes=MAX_LINE_BYTES, keep=2, fsync="never")
    for i in range(200):
        clock.now += 1
        w.record("append", index=i + 1, entry_digest=f"d{i}", detail={"pad": padding})
    w.close()
    files = find_history_files(tmp_path)
    assert files == [rotated_path(live, 2), rotated_path(live, 1), live]
    assert not rotated_path(live, 3).exists()  # the segment past `keep` was deleted
    for path in files[:2]:
        assert MAX_LINE_BYTES <= path.stat().st_size < MAX_LINE_BYTES + 2500
    events = load_histories(files)["n1"]
    indices = [e.index for e in events]
    # The newest events survive, contiguous and in order; only the oldest segments are gone.
    assert indices == list(range(indices[0], 201)) and 1 < indices[0] < 150


def test_rotation_continues_after_a_restart_and_a_torn_tail(tmp_path):
    live = tmp_path / "history.jsonl"
    w = HistoryWriter(live, "n1", max_bytes=MAX_LINE_BYTES, keep=1, fsync="never")
    for i in range(40):
        w.record("commit", index=i + 1, entry_digest="d", detail={"pad": "y" * 2000})
    w.close()
    assert rotated_path(live, 1).exists()
    with open(live, "ab") as f:
        f.write(b'{"t_wall": 1, "torn')  # a crash mid-line in the live file
    w = HistoryWriter(live, "n1", max_bytes=MAX_LINE_BYTES, keep=1, fsync="never")
    w.record("stop", index=40)
    w.close()
    history = read_history(live)
    assert not history.torn_tail and history.events[-1].kind == "stop"
    assert not read_history(rotated_path(live, 1)).torn_tail


def test_rotation_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="max_bytes"):
        HistoryWriter(tmp_path / "h.jsonl", "n1", max_bytes=100)
    with pytest.raises(ValueError, match="keep"):
        HistoryWriter(tmp_path / "h.jsonl", "n1", keep=0)
