"""Log lines under journald carry a `<N>` priority and no timestamp; --log-format json writes one
object per line; the journal is recognised by $JOURNAL_STREAM matching stderr's device and inode."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import pytest

from diloco_node.ops.logs import configure_logging, syslog_priority, under_journald


def _journal_env(path: Path) -> dict[str, str]:
    status = os.stat(path)
    return {"JOURNAL_STREAM": f"{status.st_dev}:{status.st_ino}"}


def _log_some(logger_name: str = "diloco_node.daemon") -> None:
    log = logging.getLogger(logger_name)
    log.debug("hidden at info")
    log.info("site-a ready")
    log.warning("peer b slow")
    try:
        raise RuntimeError("device lost")
    except RuntimeError:
        log.exception("learner thread failed")


def test_syslog_priorities_follow_the_python_levels() -> None:
    assert [syslog_priority(level) for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR,
                                                 logging.CRITICAL, logging.INFO + 5)] == [7, 6, 4, 3, 2, 6]


def test_journald_is_recognised_only_on_its_own_stream(tmp_path: Path) -> None:
    path = tmp_path / "stderr"
    other = tmp_path / "other"
    path.touch()
    other.touch()
    with path.open("w") as stream:
        assert under_journald(_journal_env(path), stream)
        assert not under_journald(_journal_env(other), stream)  # stderr was redirected since
        assert not under_journald({}, stream)
        assert not under_journald({"JOURNAL_STREAM": "garbage"}, stream)


def test_under_journald_every_line_has_a_priority_and_no_timestamp(tmp_path: Path, restore_root_logger) -> None:
    path = tmp_path / "stderr"
    path.touch()
    with path.open("w") as stream:
        configure_logging("info", "site-a", "auto", environ=_journal_env(path), stream=stream)
        _log_some()
    lines = path.read_text().splitlines()
    assert lines[:3] == ["<6>diloco_node.daemon: site-a ready", "<4>diloco_node.daemon: peer b slow",
                         "<3>diloco_node.daemon: learner thread failed"]
    assert len(lines) > 4 and all(line.startswith("<3>") for line in lines[3:])  # the traceback too
    assert lines[-1] == "<3>RuntimeError: device lost"
    assert not any(re.search(r"\d{4}-\d\d-\d\d", line) for line in lines)  # journald stamps the time


def test_json_lines_carry_ts_level_logger_msg_node(tmp_path: Path, restore_root_logger) -> None:
    path = tmp_path / "stderr"
    with path.open("w") as stream:
        configure_logging("info", "site-a", "json", environ={}, stream=stream)
        _log_some()
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["level"], e["logger"], e["msg"], e["node"]) for e in entries] == [
        ("info", "diloco_node.daemon", "site-a ready", "site-a"),
        ("warning", "diloco_node.daemon", "peer b slow", "site-a"),
        ("error", "diloco_node.daemon", "learner thread failed", "site-a"),
    ]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entries[0]["ts"])
    assert "RuntimeError: device lost" in entries[2]["exc"]


def test_text_elsewhere_keeps_one_timestamp_and_the_node(tmp_path: Path, restore_root_logger) -> None:
    path = tmp_path / "stderr"
    with path.open("w") as stream:
        configure_logging("warning", "site-a", "auto", environ={}, stream=stream)
        logging.getLogger("diloco_node.daemon").warning("peer b slow")
    (line,) = path.read_text().splitlines()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} site-a WARNING diloco_node.daemon: peer b slow", line)


def test_an_unknown_format_names_the_flag(restore_root_logger) -> None:
    with open(os.devnull, "w") as stream, pytest.raises(
            ValueError, match="--log-format must be one of auto, text, json, journal, got 'xml'"):
        configure_logging("info", "a", "xml", environ={}, stream=stream)
