"""sd_notify against a real AF_UNIX datagram socket, as systemd would listen."""

import asyncio
import os
import socket
import uuid

import pytest

from diloco_node.ops.liveness import ALIVE, Liveness
from diloco_node.ops.systemd import (
    EXTEND_EVERY_S,
    EXTEND_TIMEOUT_S,
    SystemdNotifier,
    extend_while_progressing,
    run_watchdog,
)


@pytest.fixture
def listener(tmp_path):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2.0)
    yield str(path), sock
    sock.close()


def _receive(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_ready_status_watchdog_stopping_reach_the_socket(listener):
    path, sock = listener
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.ready("serving on 127.0.0.1:7070")
    assert _receive(sock) == ["READY=1", "STATUS=serving on 127.0.0.1:7070"]
    assert notifier.status("epoch 3\ncommit 41")  # a newline must not start a new assignment
    assert _receive(sock) == ["STATUS=epoch 3 commit 41"]
    assert notifier.watchdog()
    assert _receive(sock) == ["WATCHDOG=1"]
    assert notifier.stopping()
    assert _receive(sock) == ["STOPPING=1"]
    notifier.close()


def test_abstract_socket_names_are_supported():
    name = f"diloco-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(2.0)
    try:
        notifier = SystemdNotifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.ready()
        assert _receive(sock) == ["READY=1"]
    finally:
        sock.close()


def test_noop_outside_systemd_and_when_the_socket_is_gone(tmp_path):
    assert not SystemdNotifier({}).enabled
    assert SystemdNotifier({}).ready() is False
    assert SystemdNotifier({"NOTIFY_SOCKET": "relative/path"}).enabled is False
    gone = SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "missing.sock")})
    assert gone.enabled and gone.watchdog() is False  # logged, never raised


def test_watchdog_interval_honours_watchdog_pid():
    pid = os.getpid()
    assert SystemdNotifier({"WATCHDOG_USEC": "20000000"}).watchdog_interval_s == 20.0
    assert SystemdNotifier({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(pid)}).watchdog_interval_s == 3.0
    assert SystemdNotifier({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(pid + 1)}).watchdog_interval_s is None
    assert SystemdNotifier({"WATCHDOG_USEC": "soon"}).watchdog_interval_s is None
    assert SystemdNotifier({}).watchdog_interval_s is None


async def test_watchdog_loop_pings_at_half_interval_only_while_healthy(listener):
    path, sock = listener
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000"})
    sleeps: list[float] = []
    health = iter([ALIVE, Liveness(False, "learner stalled"), ALIVE])

    async def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await run_watchdog(notifier, lambda: next(health), sleep=fake_sleep)
    assert sleeps == [2.0, 2.0, 2.0]
    assert _receive(sock) == ["WATCHDOG=1"]
    assert _receive(sock) == ["WATCHDOG=1"]
    sock.settimeout(0.05)
    with pytest.raises(TimeoutError):
        sock.recv(100)  # the unhealthy round sent nothing: two pings for three rounds


async def test_watchdog_loop_returns_without_a_watchdog():
    await asyncio.wait_for(run_watchdog(SystemdNotifier({}), lambda: ALIVE), timeout=1.0)


def test_an_unread_notify_socket_never_blocks_the_sender(tmp_path):
    """The daemon notifies from its event loop: a full socket queue must drop, not block."""
    path = str(tmp_path / "notify.sock")
    unread = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    unread.bind(path)
    try:
        notifier = SystemdNotifier(environ={"NOTIFY_SOCKET": path})
        # The datagram queue of an unread AF_UNIX socket holds a few hundred messages at most;
        # a blocking send would hang inside this loop (and pytest-timeout would fail the test).
        results = [notifier.status(f"step {i} " + "x" * 200) for i in range(5000)]
        assert results[0] is True
        assert results[-1] is False, "a full queue must be reported as a dropped notification"
        notifier.close()
    finally:
        unread.close()


def test_extend_timeout_reaches_the_socket_in_microseconds(listener):
    path, sock = listener
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path})
    assert notifier.extend_timeout(90.0)
    assert _receive(sock) == ["EXTEND_TIMEOUT_USEC=90000000"]
    notifier.close()


async def test_the_start_timeout_is_extended_only_while_a_download_makes_progress(listener):
    """A long state download pushes TimeoutStartSec= ahead while bytes arrive; a stuck one does not."""
    path, sock = listener
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path})
    received_bytes = iter([0, 4096, 4096, 8192])  # moving, moving, stuck, moving again
    rounds = 0

    async def fake_sleep(seconds: float) -> None:
        nonlocal rounds
        assert seconds == EXTEND_EVERY_S
        rounds += 1
        if rounds == 4:
            raise asyncio.CancelledError  # the download ended: the node cancels the task

    with pytest.raises(asyncio.CancelledError):
        await extend_while_progressing(notifier, lambda: next(received_bytes), sleep=fake_sleep)
    sock.settimeout(0.05)
    sent = []
    with pytest.raises(TimeoutError):
        while True:
            sent.append(sock.recv(100).decode())
    assert sent == [f"EXTEND_TIMEOUT_USEC={int(EXTEND_TIMEOUT_S * 1e6)}"] * 3  # the stuck round sent nothing
    notifier.close()
