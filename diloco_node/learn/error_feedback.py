"""Error feedback for a lossy uplink: what a learner's codec dropped is sent at its next send.

Per fragment p the learner keeps a remainder e_p (float32, one value per parameter: 4 bytes per
parameter at most). At each send it hands the codec x = beta * e_p + delta, the codec transmits
Q(x), and the learner keeps e_p <- x - Q(x). `quantize` must return exactly what the receiver
decodes from the learner's encoding of x (`codec_quantizer`: wire.codecs.quantize_roundtrip per
tensor), so the remainder is exactly what did not arrive. A whole-fragment message (the simulation
runner's) and a streamed contribution (the daemon's, cut into chunks of whole codec blocks)
quantize a tensor to the same values, so one quantizer serves both.

The remainders are reset when the learner's weights stop following its own sends: it adopts the
global state after an outage or installs a downloaded one (`reset`). They are part of the
learner's checkpoint (`state`/`load`), so a restarted learner keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from wire.codecs import quantize_roundtrip

Quantizer = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]


def codec_quantizer(codec: str, *, block_size: int | None = None, top_k: int | None = None) -> Quantizer:
    """Q of `codec`: what a receiver decodes from each tensor's encoding, computed without zstd.
    `block_size` and `top_k` override the scheme's defaults as in `encode_named` (topk2's C and k)."""
    def quantize(values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: np.asarray(quantize_roundtrip(np.asarray(x, np.float32), codec, block_size=block_size,
                                                    top_k=top_k), np.float32).reshape(np.shape(x))
                for name, x in values.items()}

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
        kept = remainder or {}
        new = {}
        for name in x:
            buffer = kept.get(name)
            if buffer is not None and buffer.shape == x[name].shape and buffer.flags.writeable:
                new[name] = np.subtract(x[name], q[name], out=buffer)  # the old remainder's memory, reused
            else:
                new[name] = np.subtract(x[name], q[name], dtype=np.float32)
        self._remainders[p] = new
        return x

    def remainder(self, p: int) -> dict[str, np.ndarray]:
        """A copy of fragment p's remainder (the next send overwrites the buffers in place)."""
        return {name: a.copy() for name, a in self._remainders.get(p, {}).items()}

    def reset(self, p: int | None = None) -> None:
        """Forget the remainders (of fragment p, or all): the weights no longer follow the sends."""
        if p is None:
            self._remainders.clear()
        else:
            self._remainders.pop(p, None)

    def nbytes(self) -> int:
        return sum(a.nbytes for r in self._remainders.values() for a in r.values())

    def state(self) -> dict[str, np.ndarray]:
        """Every remainder by flat parameter name (fragments partition the names): the checkpoint's.
        The buffers themselves: copy them before the next send if they must outlive it."""
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
