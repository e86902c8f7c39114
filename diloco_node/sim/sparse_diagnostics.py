"""Per-round diagnostics of a sparse (error-feedback) uplink in the simulation runner.

For each merged round of each fragment it records what tells an error-feedback bug from the
algorithm's own limits:

- `remainder_over_delta`: |e| / |delta| after the send, mean over the round's senders (a remainder
  that grows round after round is mass that never arrives);
- `sent_ever`: the fraction of the fragment's coordinates that some learner has sent at least once;
- `cosine_sent_delta`: cos(what arrived, the uncompressed delta), mean over the round's senders;
- `merged_over_dense`: |merged outer gradient| / |mean of the contributors' uncompressed deltas|;
- `contributors` and `rebased` (contributions from an older base, rebased by the merge).

Pure bookkeeping on numpy arrays: the runner calls `sent` at each send and `merged` at each merge.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np


def _norm(tree: Mapping[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.vdot(a.astype(np.float64), a.astype(np.float64))) for a in tree.values())))


def _cosine(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    dot = sum(float(np.vdot(a[n].astype(np.float64), b[n].astype(np.float64))) for n in a)
    return dot / max(_norm(a) * _norm(b), 1e-30)


class SparseDiagnostics:
    """Rows of per-round figures, one per merge of a fragment (`rows`)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self._deltas: dict[tuple[str, int], dict[str, np.ndarray]] = {}  # (learner, p) -> last raw delta
        self._pending: dict[int, list[tuple[float, float]]] = {}  # p -> (remainder/delta, cosine) per send
        self._sent_ever: dict[int, dict[str, np.ndarray]] = {}
        self._bases: dict[tuple[str, int], int] = {}

    def sent(self, learner: str, p: int, base_round: int, delta: Mapping[str, np.ndarray],
             arrived: Mapping[str, np.ndarray], remainder: Mapping[str, np.ndarray]) -> None:
        """Learner `learner` sent fragment p against global round `base_round`: its uncompressed
        delta, what the receiver decodes, and the remainder it keeps (empty without error feedback)."""
        self._deltas[(learner, p)] = {n: np.asarray(v, np.float32) for n, v in delta.items()}
        self._bases[(learner, p)] = base_round
        delta_norm = _norm(delta)
        ratio = _norm(remainder) / delta_norm if delta_norm > 0 else 0.0
        self._pending.setdefault(p, []).append((ratio, _cosine(arrived, delta)))
        mask = self._sent_ever.setdefault(p, {n: np.zeros(np.shape(v), bool) for n, v in delta.items()})
        for n, v in arrived.items():
            mask[n] |= np.asarray(v) != 0

    def merged(self, p: int, round_: int, t: float, contributors: Collection[str],
               outer_gradient: Mapping[str, np.ndarray]) -> None:
        """Fragment p reached `round_` with this merged outer gradient from `contributors` (a
        contribution sent against a round older than `round_ - 1` was rebased)."""
        rebased = sum(1 for c in contributors if self._bases.get((c, p), round_ - 1) < round_ - 1)
        pending = self._pending.pop(p, [])
        deltas = [self._deltas[(c, p)] for c in contributors if (c, p) in self._deltas]
        dense_norm = 0.0
        if deltas:
            dense_norm = _norm({n: np.mean([d[n] for d in deltas], axis=0) for n in deltas[0]})
        mask = self._sent_ever.get(p, {})
        total = sum(m.size for m in mask.values())
        self.rows.append({
            "fragment": p, "round": round_, "t": round(t, 2), "contributors": len(contributors),
            "rebased": rebased,
            "remainder_over_delta": round(float(np.mean([r for r, _ in pending])), 4) if pending else None,
            "cosine_sent_delta": round(float(np.mean([c for _, c in pending])), 4) if pending else None,
            "sent_ever": round(sum(int(m.sum()) for m in mask.values()) / total, 4) if total else None,
            "merged_over_dense": round(_norm(outer_gradient) / dense_norm, 4) if dense_norm > 0 else None,
        })
