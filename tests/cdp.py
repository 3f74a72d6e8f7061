"""A minimal headless-Chromium driver over the DevTools protocol, for the dashboard browser test.

Debian's ``chromium`` started with ``--remote-debugging-port=0`` writes the port it chose to
``DevToolsActivePort`` in its profile directory; we attach to its first page over a WebSocket
(``websockets``' sync client, which Streamlit already depends on), navigate, evaluate JavaScript and
capture screenshots. No Selenium, no driver binary, nothing downloaded.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests._sync import wait_until

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--mute-audio",
)


def find_chromium() -> str | None:
    """Path of a Chromium binary (Debian's ``chromium`` first), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Chromium:
    """One headless Chromium with one page, driven over CDP. Use as a context manager."""

    def __init__(self, binary: str, *, width: int = 1400, height: int = 2000, timeout_s: float = 30.0) -> None:
        from websockets.sync.client import connect

        self.profile = Path(tempfile.mkdtemp(prefix="ranklens-chromium-"))
        self.proc = subprocess.Popen(
            [
                binary,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={self.profile}",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._ids = itertools.count(1)
        self._stack = contextlib.ExitStack()
        try:
            port = self._wait_port(timeout_s)
            ws_url = self._page_ws(port, timeout_s)
            self.ws = self._stack.enter_context(connect(ws_url, max_size=64 * 2**20, open_timeout=timeout_s))
            self.call("Page.enable")
            self.call("Runtime.enable")
            self.call(
                "Emulation.setDeviceMetricsOverride",
                {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            )
        except BaseException:
            self.close()
            raise

    def _wait_port(self, timeout_s: float) -> int:
        marker = self.profile / "DevToolsActivePort"

        def port() -> int:  # chromium writes the port it listens on into the marker file
            try:
                return int(marker.read_text().splitlines()[0])
            except (OSError, IndexError, ValueError):
                return 0

        return wait_until(port, timeout_s, "chromium's DevTools port", interval_s=0.1, procs=[self.proc])

    @staticmethod
    def _page_ws(port: int, timeout_s: float) -> str:
        def page() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                targets = json.load(r)
            pages = [t for t in targets if t.get("type") == "page" and t.get("webSocketDebuggerUrl")]
            return str(pages[0]["webSocketDebuggerUrl"]) if pages else ""

        return wait_until(page, timeout_s, "a chromium page target", interval_s=0.1)

    def call(self, method: str, params: dict[str, Any] | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
        """Send one CDP command and return its result (events in between are skipped)."""
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params or {}}))
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer to {method}")
            msg = json.loads(self.ws.recv(timeout=left))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", {"url": url})

    def evaluate(self, expression: str) -> Any:
        """Evaluate a JavaScript expression in the page and return its (JSON) value."""
        r = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"javascript failed: {r['exceptionDetails']}")
        return r.get("result", {}).get("value")

    def screenshot(self, path: Path) -> Path:
        """Save a PNG of the viewport."""
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self._stack.close()
        except Exception:
            pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
