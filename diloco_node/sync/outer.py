"""The outer optimizer's step, and the one check for tensors that come from outside.

`nesterov_step` is what every replica applies to a committed outer gradient; `finite_float32` is
what the syncer and every replica accept as a tensor (a learner's delta, an outer gradient, a
downloaded state), so both accept exactly the same inputs. Pure numpy, float32, bit-reproducible.
"""

from __future__ import annotations

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
    if not np.all(np.isfinite(arr)):
        return None, f"non-finite values in {name}"
    with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf: caught below
        arr = arr.astype(np.float32, copy=False)
    if not np.all(np.isfinite(arr)):
        return None, f"{name} has values beyond the float32 range"
    return arr, ""


def nesterov_step(
    theta: np.ndarray, buf: np.ndarray, outer_grad: np.ndarray, lr: float, momentum: float
) -> tuple[np.ndarray, np.ndarray]:
    """SGD with Nesterov momentum: b <- mu*b + Delta; Theta <- Theta - lr*(Delta + mu*b).

    Elementwise float32 with the constants rounded to float32 first: numpy does not fuse these
    operations, so every replica gets identical bits from identical inputs. Returns new arrays.
    """
    theta32 = np.asarray(theta, dtype=np.float32)
    buf32 = np.asarray(buf, dtype=np.float32)
    grad32 = np.asarray(outer_grad, dtype=np.float32)
    if not theta32.shape == buf32.shape == grad32.shape:
        raise ValueError(f"shapes differ: theta {theta32.shape}, buffer {buf32.shape}, gradient {grad32.shape}")
    mu = np.float32(momentum)
    eta = np.float32(lr)
    with np.errstate(over="ignore", invalid="ignore"):  # callers check finiteness (GlobalState refuses)
        new_buf = mu * buf32 + grad32
        new_theta = theta32 - eta * (grad32 + mu * new_buf)
    return new_theta.astype(np.float32, copy=False), new_buf.astype(np.float32, copy=False)
