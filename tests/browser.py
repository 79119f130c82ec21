"""A real headless browser for the tests of pages the suite writes: Debian's chromium (installed
by `make test`), driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: the
browser reads JSON commands on its fd 3 and answers on its fd 4, each message ending in NUL), so
no port and no client library is needed."""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

TIMEOUT_S = 60.0


def chromium() -> str:
    """The chromium executable; an assertion that says how to get it otherwise."""
    exe = shutil.which("chromium")
    assert exe, "chromium is missing: `make test` installs Debian's chromium package"
    return exe


def dump_dom(page: Path, profile: Path) -> str:
    """The DOM chromium builds from ``page`` once its scripts ran, serialized."""
    result = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert result.returncode == 0 and "<html" in result.stdout, result.stderr[-2000:]
    return result.stdout


class Browser:
    """One headless chromium with one page, commanded over the DevTools pipe; close() kills it."""

    def __init__(self, profile: Path) -> None:
        browser_reads, self._write = os.pipe()
        self._read, browser_writes = os.pipe()

        def wire() -> None:  # in the child: the pipes onto fds 3 and 4, via fds >= 10 so none clobbers the other
            low, high = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (browser_reads, browser_writes))
            os.dup2(low, 3)
            os.dup2(high, 4)

        self._process = subprocess.Popen(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"],
            close_fds=False, preexec_fn=wire, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(browser_reads)
        os.close(browser_writes)
        self._buffer, self._last_id, self._session = b"", 0, ""

    def open(self, page: Path) -> None:
        """Load ``page`` in a new tab and wait for its load event (its inline script has run)."""
        target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self._call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self._call("Page.enable")
        self._call("Page.navigate", {"url": page.as_uri()})
        self._wait_for("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited if it is a promise)."""
        reply = self._call("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True})
        assert "exceptionDetails" not in reply, reply["exceptionDetails"]
        return reply["result"].get("value")

    def close(self) -> None:
        self._process.kill()
        self._process.wait()
        os.close(self._write)
        os.close(self._read)

    def _call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        self._last_id += 1
        message: dict[str, Any] = {"id": self._last_id, "method": method, "params": params or {}}
        if self._session:
            message["sessionId"] = self._session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        reply = self._next(lambda m: m.get("id") == self._last_id, method)
        assert "error" not in reply, f"{method}: {reply['error']}"
        return dict(reply["result"])

    def _wait_for(self, event: str) -> None:
        self._next(lambda m: m.get("method") == event, event)

    def _next(self, wanted: Any, what: str) -> dict[str, Any]:
        """The first message ``wanted`` accepts (the others are dropped), within TIMEOUT_S."""
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                if wanted(message := json.loads(raw)):
                    return dict(message)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read], [], [], left)[0]:
                raise TimeoutError(f"chromium did not answer {what} within {TIMEOUT_S:.0f}s")
            chunk = os.read(self._read, 1 << 16)
            if not chunk:
                raise RuntimeError(f"chromium exited before answering {what}")
            self._buffer += chunk
