"""The runner's two events about a child: the port it announces, and its exit."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from suite.process import read_announced_port, wait_exit

TIMEOUT_S = 30.0


async def test_the_announced_port_is_read_from_the_pipe() -> None:
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"50123\n")
    os.close(write_fd)
    assert await asyncio.wait_for(read_announced_port(read_fd), TIMEOUT_S) == 50123
    with pytest.raises(OSError):
        os.fstat(read_fd)  # the reader closed its end


async def test_a_pipe_closed_without_a_line_means_the_child_is_gone() -> None:
    read_fd, write_fd = os.pipe()
    os.close(write_fd)
    assert await asyncio.wait_for(read_announced_port(read_fd), TIMEOUT_S) is None


def child_until_stdin_closes(exit_code: int = 0) -> subprocess.Popen[bytes]:
    """A child process, like the runner's, that runs until its stdin is closed."""
    code = f"import sys; sys.stdin.read(); sys.exit({exit_code})"
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)


async def test_exit_is_awaited_as_an_event() -> None:
    child = child_until_stdin_closes(3)
    try:
        exited = asyncio.ensure_future(wait_exit(child))
        done, _ = await asyncio.wait({exited}, timeout=0.2)
        assert not done  # it waits on stdin: still running
        assert child.stdin is not None
        child.stdin.close()  # now it exits
        assert await asyncio.wait_for(exited, TIMEOUT_S) == 3
        assert await wait_exit(child) == 3  # an exited child answers at once
    finally:
        child.kill()
        child.wait()


def test_an_abandoned_wait_leaves_no_thread_the_loop_must_wait_for() -> None:
    """``asyncio.run`` waits for its worker threads: a wait for the child in one would keep it
    from returning while the child runs (the suite's children run for the whole session)."""
    child = child_until_stdin_closes()
    try:

        async def abandon() -> None:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(wait_exit(child), 0.1)

        asyncio.run(abandon())
        assert child.poll() is None  # asyncio.run returned while the child still runs
    finally:
        child.kill()
        child.wait()
