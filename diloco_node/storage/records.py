"""Checksummed record framing: a small JSON record with its format and CRC-32, the one framing of
every record file a node keeps (the coordination store's election, identity and mark records).

A record file is the record's JSON object with two more keys, `"format": 2` and `"crc32": N`, N the
CRC-32 of the record's canonical JSON (sorted keys, without those two), so a bit flip or a
truncation is found when the file is read, and a reader that only wants a field (the exporter
reads the manifest) reads it as before. A file with neither key was written before the checksum
existed and is read without one; a single flipped bit cannot remove both keys.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

RECORD_FORMAT = 2
FRAMING_KEYS = frozenset({"format", "crc32"})


class RecordError(ValueError):
    """A record file that fails its checksum or does not parse."""


def _canonical(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True).encode()


def frame(record: dict[str, Any]) -> bytes:
    """The bytes of a record file holding `record` (which must not use the two framing keys)."""
    if FRAMING_KEYS & record.keys():
        raise ValueError(f"a record may not hold {sorted(FRAMING_KEYS)}")
    return json.dumps({**record, "format": RECORD_FORMAT, "crc32": zlib.crc32(_canonical(record))},
                      sort_keys=True).encode()


def unframe(data: bytes, legacy_key: str) -> dict[str, Any]:
    """The record in a file's bytes; RecordError when damaged. A file without the framing keys
    must have `legacy_key` (the old format)."""
    try:
        raw = json.loads(data)
    except ValueError as error:  # truncated, or a flipped bit that breaks the JSON (or its UTF-8)
        raise RecordError(f"not JSON: {error}") from None
    if not isinstance(raw, dict):
        raise RecordError("not a JSON object")
    if not FRAMING_KEYS & raw.keys():
        if legacy_key not in raw:
            raise RecordError(f"neither a checksummed record nor the old format (no {legacy_key!r})")
        return raw
    record = {key: value for key, value in raw.items() if key not in FRAMING_KEYS}
    if raw.get("format") != RECORD_FORMAT or not isinstance(raw.get("crc32"), int):
        raise RecordError(f"format {raw.get('format')!r} and crc32 {raw.get('crc32')!r}: expected format "
                          f"{RECORD_FORMAT} with its checksum")
    if zlib.crc32(_canonical(record)) != raw["crc32"]:
        raise RecordError("the record fails its checksum")
    return record
