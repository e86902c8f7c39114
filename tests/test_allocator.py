"""The daemon returns large freed arrays to the system (ops/allocator.py): glibc's mmap threshold
is fixed unless the operator set one."""

from __future__ import annotations

import platform

import pytest

from diloco_node.ops import allocator


def test_an_operators_own_threshold_is_kept() -> None:
    assert allocator.return_large_frees_to_os({"MALLOC_MMAP_THRESHOLD_": "65536"}) == \
        "allocator: the operator's MALLOC_MMAP_THRESHOLD_=65536 kept"
    tunables = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=1048576"}
    assert "kept" in allocator.return_large_frees_to_os(tunables)
    assert allocator.operator_setting({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) is None


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_on_glibc_the_threshold_is_fixed(monkeypatch) -> None:
    calls = []

    class _Libc:
        def mallopt(self, parameter: int, value: int) -> int:
            calls.append((parameter, value))
            return 1

    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: _Libc())
    assert allocator.return_large_frees_to_os({}).startswith("allocator: blocks of 4 MiB or more")
    assert calls == [(-3, allocator.LARGE_BLOCK_BYTES)]
    calls.clear()
    _Libc.mallopt = lambda self, parameter, value: 0  # refused: said, not raised
    assert "refused" in allocator.return_large_frees_to_os({})
