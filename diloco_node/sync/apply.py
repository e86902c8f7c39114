"""The learner's apply rule: how a merged global fragment enters the local model, and its counters.

One pure function, used by the daemon's training thread (`learn/learner_thread.py`) and by every
learner of the in-process runner (`sim/runner.py`):

    apply_merge(local, base, merged, contributors, counters, learner=..., rule=...)
        -> (new local fragment, new counters)

- The merge includes this learner's contribution (or it has no unsent steps): the merged
  fragment replaces the local one (`overwrite`, the paper's rule) or is mixed with it
  (`mix`: alpha * local + (1 - alpha) * merged, Streaming DiLoCo's alternative), and the
  fragment's counters restart at zero: the steps they counted are in the merge.
- `eager` (eager updates, arXiv 2502.12996, in Streaming DiLoCo's overlap form): the merge
  includes this learner's contribution, and the progress it made while the round was in flight
  (local - the fragment as sent) is taken on top of the merged fragment instead of being
  overwritten; the counters keep only the steps since the send, which the next contribution
  carries. It needs the fragment as sent (`sent`), which only the in-process runner keeps, so a
  learner that does not keep it refuses the rule when it is built (`from_sync_spec`). A merge
  with no send of ours pending (`sent` None: already taken by an earlier merge) overwrites.
- The merge lacks this learner's contribution while it has unsent steps (a straggler's lone
  round, a contribution that arrived late or was dropped) and `keep_unmerged` is set: the global
  change is taken on top of the local progress, local + (merged - base), and the counters are
  kept, so the next contribution still carries those steps. With `keep_unmerged` off they are
  discarded (overwrite, counters reset).

`base` is the global fragment the learner last applied (what its deltas are computed against);
`contributors` are the learners whose contributions the merges since `base` accepted.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from diloco_node.config.manifest import SyncSpec


@dataclass(frozen=True, slots=True)
class FragmentCounters:
    """Inner steps and tokens since this learner last received the fragment (the merge weights)."""

    c_steps: int = 0
    c_tokens: int = 0


ZERO = FragmentCounters()


@dataclass(frozen=True, slots=True)
class SentFragment:
    """This learner's fragment as it was when it sent its last contribution, and its counters then."""

    params: Mapping[str, np.ndarray]
    counters: FragmentCounters


@dataclass(frozen=True, slots=True)
class ApplyRule:
    mode: str = "overwrite"  # or "mix", "eager"
    mix_alpha: float = 0.5
    keep_unmerged: bool = False

    @classmethod
    def from_sync_spec(cls, sync: SyncSpec, *, keeps_sent: bool = False) -> ApplyRule:
        """The manifest's rule; `keeps_sent`: the caller passes `sent` to every merge (the rule
        `eager` needs it, and a learner that cannot supply it refuses the rule here, before training)."""
        if sync.apply == "eager" and not keeps_sent:
            raise ValueError("sync.apply = eager: this learner does not keep its fragment as sent "
                             "(only the in-process runner does); use overwrite or mix")
        return cls(sync.apply, sync.mix_alpha, sync.keep_unmerged)


def apply_merge(local: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray], merged: Mapping[str, np.ndarray],
                contributors: Collection[str], counters: FragmentCounters, *, learner: str,
                rule: ApplyRule, sent: SentFragment | None = None) -> tuple[dict[str, np.ndarray], FragmentCounters]:
    """The learner's new fragment (fp32, every tensor of `merged`) and counters; see the module doc."""
    if rule.keep_unmerged and learner not in contributors and counters.c_steps > 0:
        return {n: (local[n] + (v - base[n])).astype(np.float32) for n, v in merged.items()}, counters
    if rule.mode == "eager" and learner in contributors and sent is not None:
        since = FragmentCounters(max(0, counters.c_steps - sent.counters.c_steps),
                                 max(0, counters.c_tokens - sent.counters.c_tokens))
        return {n: (v + (local[n] - sent.params[n])).astype(np.float32) for n, v in merged.items()}, since
    if rule.mode == "mix":
        alpha = rule.mix_alpha
        return {n: (alpha * local[n] + (1 - alpha) * v).astype(np.float32) for n, v in merged.items()}, ZERO
    return {n: np.asarray(v, dtype=np.float32) for n, v in merged.items()}, ZERO
