"""The in-process runner's stacked batches, drawn one tick ahead and placed on the device early.

Each learner draws its windows from its own `BatchSampler` in a fixed order, so a learner's n-th
batch is the same whichever tick it is used in. After a tick the next tick's stacked batch is
built for the same set of stepping learners and handed to `jax.device_put`, which returns at
once: the copy overlaps the step the device is still running. When the next tick steps a
different set (a straggler, an outage), the batch is rebuilt from the rows already drawn, so
prefetching never changes which windows a learner sees.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from diloco_node.learn import data as data_lib


class StackedBatches:
    """`take(mask)` -> (inputs_MxBxL, targets_MxBxL) for the learners where `mask` is True; rows of
    the others are zeros (the masked step ignores them)."""

    def __init__(self, samplers: Sequence[data_lib.BatchSampler], batch_size: int, seq_len: int,
                 prefetch: bool = True):
        self._samplers = list(samplers)
        self._zero = np.zeros((batch_size, seq_len), np.int32)
        self._drawn: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(samplers)
        self._prefetch = prefetch
        self._ahead: tuple[tuple[bool, ...], object, object] | None = None
        self.prefetch_hits = 0

    def _row(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        if self._drawn[m] is None:
            self._drawn[m] = self._samplers[m].next()
        return self._drawn[m]

    def _build(self, mask: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
        rows = [self._row(m) if on else (self._zero, self._zero) for m, on in enumerate(mask)]
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])

    def take(self, mask: Sequence[bool]) -> tuple[object, object]:
        key = tuple(bool(x) for x in mask)
        if self._ahead is not None and self._ahead[0] == key:
            inputs, targets = self._ahead[1], self._ahead[2]
            self.prefetch_hits += 1
        else:
            inputs, targets = self._build(key)
        self._ahead = None
        for m, on in enumerate(key):
            if on:
                self._drawn[m] = None  # consumed: the learner's next batch is drawn afresh
        if self._prefetch:
            # The next tick most often steps the same learners (every one, in a uniform run).
            host_in, host_tg = self._build(key)
            self._ahead = (key, jax.device_put(host_in), jax.device_put(host_tg))
        return inputs, targets
