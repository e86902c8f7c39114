"""The outer optimizer's step, and the one check for tensors that come from outside.

`nesterov_step` (computed chunk by chunk: `nesterov_chunks`) is what every replica applies to a
committed outer gradient; `finite_float32` is what the syncer and every replica accept as a
tensor (a learner's delta, an outer gradient, a downloaded state), so both accept exactly the
same inputs. Pure numpy, float32, bit-reproducible.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def finite_float32(value: object, name: str, shape: tuple[int, ...] | None) -> tuple[np.ndarray | None, str]:
    """`value` as a float32 array (of `shape`, unless None) with finite values, or (None, reason).

    The one check for tensors from outside (a learner's delta, an outer gradient, a snapshot), so
    the syncer and every replica accept exactly the same inputs. The array may share memory with
    `value`; copy it before keeping it.
    """
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError):  # e.g. ragged nested lists
        return None, f"{name} is not a numeric array"
    if arr.dtype.kind != "f":
        return None, f"{name} has dtype {arr.dtype}, expected float32"
    if shape is not None and arr.shape != shape:
        return None, f"{name} has shape {arr.shape}, expected {shape}"
    with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf: caught below
        arr32 = arr.astype(np.float32, copy=False)
    # One scan of the float32 values (they are what is kept): a non-finite input stays non-finite.
    # The input itself is scanned again only to say which of the two reasons it was.
    if not all_finite(arr32):
        if arr32 is arr or not all_finite(arr):
            return None, f"non-finite values in {name}"
        return None, f"{name} has values beyond the float32 range"
    return arr32, ""


# Elements `all_finite` checks at a time: its boolean temporary is one chunk's (1 MiB), not an
# array's (a 1B model's embedding would need 250 MB of fresh pages for it).
FINITE_CHUNK_ELEMENTS = 1 << 20


def all_finite(arr: np.ndarray) -> bool:
    """Whether every value of `arr` is finite, a chunk at a time, stopping at the first bad chunk."""
    if not arr.flags.c_contiguous:
        return bool(np.all(np.isfinite(arr)))
    flat = arr.reshape(-1)
    for start in range(0, flat.size, FINITE_CHUNK_ELEMENTS):
        if not np.isfinite(flat[start:start + FINITE_CHUNK_ELEMENTS]).all():
            return False
    return True


# Elements one chunk of the step works on (256 KiB of float32): the step's float32 temporaries
# are chunk-sized, not fragment-sized (a 1B model's embedding is one 250 MiB tensor).
STEP_CHUNK_ELEMENTS = 1 << 16


def nesterov_chunks(
    theta: np.ndarray, buf: np.ndarray, outer_grad: np.ndarray, lr: float, momentum: float
) -> Iterator[tuple[slice, np.ndarray, np.ndarray]]:
    """The Nesterov step, a chunk at a time: (part of the flattened tensor, new theta, new buffer).

    b <- mu*b + Delta; Theta <- Theta - lr*(Delta + mu*b), elementwise float32 with the constants
    rounded to float32 first: numpy does not fuse these operations, so every replica gets
    identical bits from identical inputs, and a chunk's bits are those of the whole-array
    expression. The yielded arrays are fresh (the caller may keep them); the inputs are only read.
    """
    theta32 = np.asarray(theta, dtype=np.float32)
    buf32 = np.asarray(buf, dtype=np.float32)
    grad32 = np.asarray(outer_grad, dtype=np.float32)
    if not theta32.shape == buf32.shape == grad32.shape:
        raise ValueError(f"shapes differ: theta {theta32.shape}, buffer {buf32.shape}, gradient {grad32.shape}")
    mu = np.float32(momentum)
    eta = np.float32(lr)
    flat_theta, flat_buf, flat_grad = theta32.reshape(-1), buf32.reshape(-1), grad32.reshape(-1)
    for start in range(0, flat_theta.size, STEP_CHUNK_ELEMENTS):
        part = slice(start, min(start + STEP_CHUNK_ELEMENTS, flat_theta.size))
        grad_part = flat_grad[part]
        with np.errstate(over="ignore", invalid="ignore"):  # callers check finiteness (GlobalState refuses)
            new_buf = mu * flat_buf[part] + grad_part
            new_theta = flat_theta[part] - eta * (grad_part + mu * new_buf)
        yield part, new_theta, new_buf


def nesterov_step(
    theta: np.ndarray, buf: np.ndarray, outer_grad: np.ndarray, lr: float, momentum: float
) -> tuple[np.ndarray, np.ndarray]:
    """SGD with Nesterov momentum: b <- mu*b + Delta; Theta <- Theta - lr*(Delta + mu*b).

    Returns new float32 arrays (theta, buffer) in the input shape, written chunk by chunk
    (`nesterov_chunks`): besides its two results the step holds one chunk of temporaries.
    """
    new_theta = np.empty(np.shape(theta), dtype=np.float32)
    new_buf = np.empty(np.shape(theta), dtype=np.float32)
    flat_theta, flat_buf = new_theta.reshape(-1), new_buf.reshape(-1)
    for part, theta_part, buf_part in nesterov_chunks(theta, buf, outer_grad, lr, momentum):
        flat_theta[part] = theta_part
        flat_buf[part] = buf_part
    return new_theta, new_buf
