"""`finite_float32`, the one check of tensors from outside: float32 input is scanned once, in chunks,
and each way of failing keeps its own reason."""

from __future__ import annotations

import numpy as np
import pytest

from diloco_node.sync import outer
from diloco_node.sync.outer import all_finite, finite_float32


def test_float32_input_is_scanned_once_in_chunks_and_returned_as_is(monkeypatch) -> None:
    monkeypatch.setattr(outer, "FINITE_CHUNK_ELEMENTS", 1000)
    scanned: list[int] = []
    real = np.isfinite
    monkeypatch.setattr(outer.np, "isfinite", lambda a: scanned.append(a.size) or real(a))
    value = np.arange(4500, dtype=np.float32).reshape(9, 500)
    arr, why = finite_float32(value, "w", (9, 500))
    assert arr is value and why == ""
    assert scanned == [1000, 1000, 1000, 1000, 500]  # every value once, never a whole-array temporary


@pytest.mark.parametrize(("value", "reason"), [
    (np.array([1.0, np.nan], np.float32), "non-finite values in w"),
    (np.array([1.0, np.inf], np.float64), "non-finite values in w"),
    (np.array([1.0, 1e39], np.float64), "w has values beyond the float32 range"),
    (np.array([1, 2], np.int32), "w has dtype int32, expected float32"),
])
def test_each_failure_keeps_its_reason(value: np.ndarray, reason: str) -> None:
    assert finite_float32(value, "w", None) == (None, reason)


def test_a_bad_value_in_any_chunk_or_a_strided_view_is_found(monkeypatch) -> None:
    monkeypatch.setattr(outer, "FINITE_CHUNK_ELEMENTS", 128)
    values = np.zeros(1000, np.float32)
    values[999] = np.nan
    assert not all_finite(values) and not all_finite(values.reshape(10, 100).T)
    assert all_finite(values[:999]) and all_finite(values[::2])
    converted, why = finite_float32(np.ones(3, np.float64), "w", None)
    assert converted.dtype == np.float32 and why == ""
