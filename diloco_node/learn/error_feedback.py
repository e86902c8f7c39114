"""Error feedback for a lossy uplink: what a learner's codec dropped is sent at its next send.

Per fragment p the learner keeps a remainder e_p (float32, one value per parameter: 4 bytes per
parameter at most). At each send it hands the codec x = beta * e_p + delta, the codec transmits
Q(x), and the learner keeps e_p <- x - Q(x). `quantize` must return exactly what the receiver
decodes from the learner's encoding of x (wire.codecs.quantize_roundtrip, cut the way the sender
cuts tensors: `whole_tensor_quantizer` for a whole-fragment message, `stream_quantizer` for the
chunks of a streamed contribution), so the remainder is exactly what did not arrive.

The remainders are reset when the learner's weights stop following its own sends: it adopts the
global state after an outage or installs a downloaded one (`reset`). They are part of the
learner's checkpoint (`state`/`load`), so a restarted learner keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from wire.contribution_stream import ChunkPlan, chunk_elements_for
from wire.limits import DEFAULT_LIMITS, Limits

Quantizer = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]


def whole_tensor_quantizer(codec: str) -> Quantizer:
    """Q of a message that encodes each tensor whole (`encode_named`, the simulation runner's)."""
    from wire.codecs import quantize_roundtrip

    def quantize(values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: np.asarray(quantize_roundtrip(np.asarray(x, np.float32), codec), np.float32).reshape(np.shape(x))
                for name, x in values.items()}

    return quantize


def stream_quantizer(codec: str, limits: Limits = DEFAULT_LIMITS) -> Quantizer:
    """Q of a streamed contribution (wire.contribution_stream): each tensor cut into the chunks the
    sender encodes one by one, each chunk quantized on its own, as the receiver decodes it."""
    from wire.codecs import quantize_roundtrip
    per_chunk = chunk_elements_for(codec, limits)

    def quantize(values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for name, x in values.items():
            flat = np.asarray(x, np.float32).reshape(-1)
            q = np.empty_like(flat)
            for offset, size in ChunkPlan(name, tuple(np.shape(x)), per_chunk).chunk_sizes():
                q[offset:offset + size] = np.asarray(quantize_roundtrip(flat[offset:offset + size], codec)).reshape(-1)
            out[name] = q.reshape(np.shape(x))
        return out

    return quantize


class ErrorFeedback:
    """The remainders of one learner, per fragment (flat parameter name -> float32 array)."""

    def __init__(self, decay: float, quantize: Quantizer) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"error feedback decay = {decay}: must be in [0, 1]")
        self.decay = float(decay)
        self.quantize = quantize
        self._remainders: dict[int, dict[str, np.ndarray]] = {}

    def compensate(self, p: int, delta: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """x = beta * e_p + delta, what the codec is to encode; e_p becomes x - Q(x). The caller
        sends x (its encoding decodes to Q(x)); `delta` itself is left as it was."""
        remainder = self._remainders.get(p)
        x = {}
        for name, d in delta.items():
            d = np.asarray(d, np.float32)
            if remainder is None or name not in remainder:
                x[name] = d.copy()
            elif self.decay == 1.0:
                x[name] = np.add(remainder[name], d, dtype=np.float32)
            else:
                x[name] = np.add(np.float32(self.decay) * remainder[name], d, dtype=np.float32)
        q = self.quantize(x)
        self._remainders[p] = {name: np.subtract(x[name], q[name], dtype=np.float32) for name in x}
        return x

    def remainder(self, p: int) -> dict[str, np.ndarray]:
        return dict(self._remainders.get(p, {}))

    def reset(self, p: int | None = None) -> None:
        """Forget the remainders (of fragment p, or all): the weights no longer follow the sends."""
        if p is None:
            self._remainders.clear()
        else:
            self._remainders.pop(p, None)

    def nbytes(self) -> int:
        return sum(a.nbytes for r in self._remainders.values() for a in r.values())

    def state(self) -> dict[str, np.ndarray]:
        """Every remainder by flat parameter name (fragments partition the names): the checkpoint's."""
        return {name: a for r in self._remainders.values() for name, a in r.items()}

    def load(self, flat: Mapping[str, np.ndarray], fragments: Mapping[int, tuple[str, ...]]) -> None:
        """Replace every remainder with a checkpoint's (`state`); names outside `fragments` are refused."""
        known = {name for names in fragments.values() for name in names}
        unknown = sorted(set(flat) - known)
        if unknown:
            raise ValueError(f"error feedback remainders for unknown parameters: {', '.join(unknown[:3])}")
        self._remainders = {}
        for p, names in fragments.items():
            part = {n: np.array(flat[n], np.float32) for n in names if n in flat}
            if part:
                self._remainders[p] = part
