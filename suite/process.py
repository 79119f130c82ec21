"""One service as a child process, and the two events the runner waits on: the port it bound
and its exit.

A child gets the write end of a pipe as its ``announce_fd`` setting and writes the port it bound
there, one line, once it listens (``aiserve.common.server.announce_port``); end-of-file without
a line means it exited first. Its exit is awaited through a pidfd that becomes readable when the
process ends. Both are events on the event loop: no polling, no thread left blocked in
``Popen.wait`` (``asyncio.run`` would wait for such a thread, that is for the child, to end).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import IO


def spawn_service(name: str, env: Mapping[str, str], log: IO[bytes]) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``python -m services.<name>`` with its output in ``log``; return the process and
    the read end of the pipe it announces its port on (the caller owns and closes it)."""
    read_fd, write_fd = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", f"services.{name}"],
            env={**env, f"AISERVE_{name.upper()}_ANNOUNCE_FD": str(write_fd)},
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=(write_fd,),
            start_new_session=True,  # Ctrl-C reaches the supervisor, which stops children in order
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)  # the child holds its own copy: its exit closes the pipe
    return process, read_fd


async def read_announced_port(read_fd: int) -> int | None:
    """The port a child announces on ``read_fd`` (which this closes), or None when it exited
    without announcing one."""
    ports = await read_announced_ports(read_fd)
    return ports[0] if ports else None


async def read_announced_ports(read_fd: int) -> tuple[int, ...]:
    """Every port a child announces on ``read_fd`` (which this closes): its gRPC port first,
    then any other (the gateway's HTTP port); () when it exited without announcing."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    pipe = os.fdopen(read_fd, "rb", buffering=0)
    try:
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    except BaseException:
        pipe.close()
        raise
    try:
        line = await reader.readline()
    finally:
        transport.close()
    return tuple(int(word) for word in line.split())


async def wait_exit(process: subprocess.Popen[bytes]) -> int:
    """The child's exit code, once it has exited."""
    if process.poll() is not None:
        return process.returncode
    try:
        pidfd = os.pidfd_open(process.pid)
    except ProcessLookupError:  # reaped between poll() and here
        return process.wait()
    except (AttributeError, OSError):  # no pidfd (not Linux, or an old kernel)
        await _exit_from_thread(process)
        return process.wait()
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()
    loop.add_reader(pidfd, _settle, exited)
    try:
        await exited
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return process.wait()


def _settle(future: asyncio.Future[None]) -> None:
    """Mark ``future`` done (once: a pidfd stays readable)."""
    if not future.done():
        future.set_result(None)


async def _exit_from_thread(process: subprocess.Popen[bytes]) -> None:
    """Where there is no pidfd: a daemon thread waits and wakes the loop (daemon, so that a loop
    that ends first neither waits for it nor is woken after it closed)."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def wait() -> None:
        process.wait()
        try:
            loop.call_soon_threadsafe(_settle, exited)
        except RuntimeError:  # the loop closed meanwhile: nobody waits any more
            pass

    threading.Thread(target=wait, name=f"wait-{process.pid}", daemon=True).start()
    await exited
