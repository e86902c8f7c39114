"""How a learner takes a committed global fragment: the one apply rule of the runner and the daemon.

Pure: numpy dicts of one fragment's tensors in, the learner's new fragment and counters out; no
clock, no JAX, no I/O. `sim/runner.py` (its learners) and `learn/learner_thread.py` (the daemon's
training thread) both call it, so the parity figures describe the rule the daemon runs.

Rules (manifest `sync.apply`):
- `overwrite` (the paper's): the merged fragment replaces the local one, counters restart at 0.
- `rebase`: as overwrite when the learner's work is in the merge, or when it has nothing unsent
  (c_steps 0). When the merge lacks its contribution (e.g. a straggler's lone round, or a round
  that closed before its push arrived) and it has unsent progress, it takes the global change on
  top of its own model, local <- local + (merged - base), and keeps its counters: that progress
  is still to be sent, and its next delta (against the new base) carries it.
- `mix` (Streaming DiLoCo's option): local <- alpha * local + (1 - alpha) * merged, counters reset.

`contributors` None means "not known": a downloaded or repaired fragment, or the missed merges a
learner back from an outage fetches. Its local work is then no base to build on, so the merged
fragment is taken as is under every rule.

When several commits of one fragment are collapsed into one application (the learner thread
keeps only the newest offer), pass the union of their contributors since the learner's base:
"my work is in the merge" must hold for any round after the base, or the rebase would add the
learner's own progress a second time.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from diloco_node.config.manifest import SyncSpec

OVERWRITE, REBASE, MIX = "overwrite", "rebase", "mix"
APPLY_RULES = (OVERWRITE, REBASE, MIX)

# What an application does to the local fragment (ApplyStep.action).
TAKE_MERGED = "take merged"  # new local = merged (no need to read the local fragment)
ADD_GLOBAL_CHANGE = "add global change"  # new local = local + (merged - base)
MIX_WITH_LOCAL = "mix with local"  # new local = alpha * local + (1 - alpha) * merged


@dataclass(frozen=True, slots=True)
class Counters:
    """A learner's work on one fragment since its base: what its next contribution claims."""

    c_steps: int
    c_tokens: int


NO_WORK = Counters(0, 0)


@dataclass(frozen=True, slots=True)
class ApplyRule:
    """The run's apply rule (`sync.apply`) and, for mix, the local weight alpha (`sync.mix_alpha`)."""

    name: str = OVERWRITE
    mix_alpha: float = 0.5

    def __post_init__(self) -> None:
        if self.name not in APPLY_RULES:
            raise ValueError(f"apply rule {self.name!r}: must be one of {', '.join(APPLY_RULES)}")
        if not 0.0 <= self.mix_alpha <= 1.0:
            raise ValueError(f"mix_alpha = {self.mix_alpha}: must be in [0, 1]")

    @classmethod
    def from_sync_spec(cls, sync: SyncSpec) -> ApplyRule:
        return cls(sync.apply, sync.mix_alpha)


@dataclass(frozen=True, slots=True)
class ApplyStep:
    """What applying one committed fragment does: the action, the counters after it, and why."""

    action: str
    counters: Counters
    reason: str


def choose_step(rule: ApplyRule, learner: str, contributors: Collection[str] | None,
                counters: Counters) -> ApplyStep:
    """The branch of the rule, without touching tensors (the learner thread's fast path writes
    the merged fragment straight from its device copies when the answer is TAKE_MERGED)."""
    if contributors is None:
        return ApplyStep(TAKE_MERGED, NO_WORK, "contributors unknown (downloaded state): merged fragment taken")
    if rule.name == MIX:
        return ApplyStep(MIX_WITH_LOCAL, NO_WORK, f"mix: {rule.mix_alpha:g} local + {1 - rule.mix_alpha:g} merged")
    contributed = learner in contributors
    if rule.name == REBASE and not contributed and counters.c_steps > 0:
        return ApplyStep(ADD_GLOBAL_CHANGE, counters,
                         f"rebase: merge lacks {learner}'s {counters.c_steps} unsent step(s); global change "
                         "added to the local fragment, counters kept")
    if contributed:
        why = f"{learner}'s contribution is in the merge"
    elif counters.c_steps == 0:
        why = f"{learner} has no unsent steps"
    else:
        why = f"merge lacks {learner}'s {counters.c_steps} unsent step(s), discarded"
    return ApplyStep(TAKE_MERGED, NO_WORK, f"{rule.name}: merged fragment taken ({why})")


def new_local(step: ApplyStep, rule: ApplyRule, local: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray],
              merged: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The learner's fragment after `step` (float32; every tensor of `merged`)."""
    if step.action == TAKE_MERGED:
        return {n: np.asarray(v, np.float32) for n, v in merged.items()}
    if step.action == ADD_GLOBAL_CHANGE:
        return {n: (local[n] + (v - base[n])).astype(np.float32) for n, v in merged.items()}
    if step.action == MIX_WITH_LOCAL:
        alpha = rule.mix_alpha
        return {n: (alpha * local[n] + (1 - alpha) * v).astype(np.float32) for n, v in merged.items()}
    raise ValueError(f"unknown apply action {step.action!r}")


def apply_fragment(rule: ApplyRule, learner: str, local: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray],
                   merged: Mapping[str, np.ndarray], contributors: Collection[str] | None,
                   counters: Counters) -> tuple[dict[str, np.ndarray], Counters, str]:
    """(new local fragment, counters after, reason) for a learner taking a committed fragment.

    `base` is the global fragment the learner's counters are counted from (its last applied
    round), `merged` the committed one, `contributors` the learners whose work the commits since
    `base` accepted (None: not known)."""
    step = choose_step(rule, learner, contributors, counters)
    return new_local(step, rule, local, base, merged), step.counters, step.reason
