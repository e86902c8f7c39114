"""The WAN link emulator as its own process (`diloco-node linkemu`): it forwards through its link
and stops on SIGTERM (the toxics in-process: tests/test_linkemu.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from conftest import roundtrip

pytestmark = pytest.mark.integration


async def test_standalone_process_forwards_and_stops_on_sigterm(echo_port: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco_node", "linkemu", "--listen", "127.0.0.1:0",
         "--upstream", f"127.0.0.1:{echo_port}", "--bandwidth-mbit", "200", "--latency-ms", "5"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
        assert line.startswith("linkemu listening on 127.0.0.1:"), line
        port = int(line.split()[3].rsplit(":", 1)[1])
        assert await roundtrip(port, b"via process") == b"via process"
    finally:
        proc.terminate()
        assert await asyncio.to_thread(proc.wait, 10) == 0
        proc.stdout.close()
