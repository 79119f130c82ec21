"""Server plumbing: the port announcement a runner reads to learn where a service listens."""

from __future__ import annotations

import os

import pytest

from aiserve.common.server import announce_port


def test_announce_port_writes_one_line_and_closes_the_descriptor() -> None:
    read_fd, write_fd = os.pipe()
    try:
        announce_port(write_fd, 50123)
        with pytest.raises(OSError):
            os.fstat(write_fd)  # closed: the reader sees end-of-file after the line
        assert os.read(read_fd, 100) == b"50123\n"
        assert os.read(read_fd, 100) == b""
    finally:
        os.close(read_fd)


def test_no_descriptor_no_announcement() -> None:
    announce_port(-1, 50123)  # nothing to write to, nothing raised
