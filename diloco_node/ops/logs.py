"""How the daemon's log lines look: journald priorities under systemd, JSON lines or plain text.

Under systemd, stderr goes to journald, which stamps every line with its own time and reads a
leading `<N>` (a syslog priority, sd-daemon(3)) as the line's level. So there the node writes
`<N>logger: message`, with no timestamp of its own: `journalctl -p warning` then filters, and
no line carries two times. journald is detected as systemd.exec(5) says: `$JOURNAL_STREAM`
names the device and inode of the stream it gave us, and stderr is still that stream.
Elsewhere `--log-format json` writes one JSON object per line (ts, level, logger, msg, node)
for a log shipper, and `text` (the default) a timestamped line for a terminal.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Mapping
from typing import TextIO

LOG_FORMATS = ("auto", "text", "json", "journal")

# syslog(3) priorities by Python level; between two levels the more severe priority applies.
_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))
_DEBUG_PRIORITY = 7


def syslog_priority(levelno: int) -> int:
    for level, priority in _PRIORITIES:
        if levelno >= level:
            return priority
    return _DEBUG_PRIORITY


def under_journald(environ: Mapping[str, str], stream: TextIO) -> bool:
    """True when `stream` is the journal stream systemd connected (not a pipe we were given later)."""
    value = environ.get("JOURNAL_STREAM", "")
    device, _, inode = value.partition(":")
    if not (device.isdigit() and inode.isdigit()):
        return False
    try:
        status = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (status.st_dev, status.st_ino) == (int(device), int(inode))


class JournalFormatter(logging.Formatter):
    """`<N>logger: message`, every line of a multi-line record (a traceback) with the priority,
    since journald parses the prefix per line."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"{record.name}: {super().format(record)}"
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in text.splitlines() or [""])


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, RFC 3339), level, logger, msg, node (and exc)."""

    def __init__(self, node_id: str) -> None:
        super().__init__()
        self.node_id = node_id

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        entry: dict[str, object] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "node": self.node_id,
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)  # newlines in msg are escaped: one line


def formatter_for(log_format: str, node_id: str, environ: Mapping[str, str], stream: TextIO) -> logging.Formatter:
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    if log_format == "auto":
        log_format = "journal" if under_journald(environ, stream) else "text"
    if log_format == "journal":
        return JournalFormatter()
    if log_format == "json":
        return JsonFormatter(node_id)
    return logging.Formatter(f"%(asctime)s {node_id} %(levelname)s %(name)s: %(message)s")


def configure_logging(level: str, node_id: str, log_format: str = "auto", *,
                      environ: Mapping[str, str] | None = None, stream: TextIO) -> logging.Handler:
    """One handler on the root logger, writing to `stream` in the chosen format; returns it."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter_for(log_format, node_id, os.environ if environ is None else environ, stream))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
