"""Named recipes for `[run.sync] preset`: a set of sync and outer keys a config names at once.

A preset fills in the keys the config leaves out; a key the config sets itself wins. The manifest
keeps the expanded keys, not the preset's name, so every site agrees on (and digests) the values
themselves, and a later change of a preset cannot change a running run.

- `sparseloco`: SparseLoCo (arXiv 2508.15706) as this project runs it: each learner sends the top
  64 of every 4,096 values of its outer gradient at 2 bits (`topk2`) with error feedback that
  decays by beta = 0.9, the merged update travels as a sparse union at int8 (`union8`), each
  coordinate is averaged over the learners that sent it (`support_mean`, as SparseLoCo's public
  configuration does: 7% better than the plain mean in this recipe on both seeds measured), and
  the outer step is SGD with no momentum (the error-feedback remainder takes momentum's place).
  Each fragment syncs every H = 20 steps: with beta 0.9 that is 4.8% and 4.2% better than the
  paper's H 28 and beta 0.95 (seeds 0, 1) and still about 1,150x fewer bytes than data-parallel
  at 140k parameters; there the outer lr 1.5 is 1.8% and 1.5% better than the paper's 1 (1.3 and
  1.8 are between). Measured against int4 in docs/PARITY.md ("The `sparseloco` preset").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SYNC_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "sparseloco": {
        "sync": {"codec_up": "topk2", "codec_down": "union8", "error_feedback": True,
                 "error_feedback_decay": 0.9, "merge": "support_mean", "period": 20},
        "outer": {"lr": 1.5, "momentum": 0.0},
    },
}


def expand_preset(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest mapping with `sync.preset` (if any) removed and its keys filled in where the
    mapping does not set them. An unknown preset is a ValueError naming the known ones."""
    sync = raw.get("sync")
    if not isinstance(sync, Mapping) or "preset" not in sync:
        return dict(raw)
    name = sync["preset"]
    if name not in SYNC_PRESETS:
        raise ValueError(f"sync.preset = {name!r}: must be one of {', '.join(SYNC_PRESETS)}")
    out = dict(raw)
    for section, values in SYNC_PRESETS[name].items():
        given = out.get(section, {})
        if not isinstance(given, Mapping):
            return out  # the section's own check names the problem
        merged = {k: v for k, v in given.items() if not (section == "sync" and k == "preset")}
        out[section] = {**values, **merged}
    return out
