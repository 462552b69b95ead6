"""Headless Chromium (Debian's package) driven over the DevTools protocol: navigate, evaluate, screenshot, and
a record of every request the page made. No browser download, no driver: a websocket to the browser itself."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--window-size=1200,1400",
)


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Browser:
    """One Chromium process and one page; `requests` lists every URL the page asked for."""

    def __init__(self, workdir: Path | None = None) -> None:
        import websocket

        exe = chromium_path()
        if exe is None:
            raise RuntimeError("chromium is not installed (scripts/setup installs Debian's package)")
        self.profile = Path(tempfile.mkdtemp(prefix="chromium-", dir=workdir))
        log = (self.profile / "chromium.log").open("wb")
        self.proc = subprocess.Popen(
            [exe, *CHROMIUM_FLAGS, "--remote-debugging-port=0", f"--user-data-dir={self.profile}", "about:blank"],
            stdout=log,
            stderr=log,
        )
        port = self._port()
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        page = next(t for t in targets if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self._next_id = 0
        self.requests: list[str] = []
        self.exceptions: list[str] = []
        for domain in ("Page", "Network", "Runtime"):
            self.call(f"{domain}.enable")

    def _port(self) -> int:
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not marker.exists() or not marker.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start: {(self.profile / 'chromium.log').read_text()[-2000:]}")
            time.sleep(0.05)
        return int(marker.read_text().split()[0])

    def _event(self, msg: dict[str, Any]) -> None:
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Runtime.exceptionThrown":
            self.exceptions.append(json.dumps(params.get("exceptionDetails", {}))[:500])
        elif method == "Page.javascriptDialogOpening":  # the cancel button's confirm(): accept it
            self._send("Page.handleJavaScriptDialog", {"accept": True})

    def _send(self, method: str, params: dict[str, Any] | None = None) -> int:
        self._next_id += 1
        self.ws.send(json.dumps({"id": self._next_id, "method": method, "params": params or {}}))
        return self._next_id

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        want = self._send(method, params)
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == want:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._event(msg)

    def pump(self, seconds: float) -> None:
        """Handle events for a while (requests, dialogs) without a command of ours in flight."""
        self.ws.settimeout(0.1)
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                try:
                    self._event(json.loads(self.ws.recv()))
                except Exception:  # the timeout: nothing arrived
                    continue
        finally:
            self.ws.settimeout(60)

    def goto(self, url: str) -> None:
        self.call("Page.navigate", {"url": url})

    def eval(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.eval(expression)
            except RuntimeError:  # the page is still loading: its elements are not there yet
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression!r} stayed falsy; page text: {self.eval('document.body.innerText')!r}")
            self.pump(0.2)

    def screenshot(self, path: Path, *, full_page: bool = False) -> Path:
        """A PNG of the viewport, or of the whole page (`full_page`, up to 6,000 px high)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.call("Page.getLayoutMetrics")["cssContentSize"]
            clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 6000), "scale": 1}
            params.update(captureBeyondViewport=True, clip=clip)
        data = self.call("Page.captureScreenshot", params)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def viewport(self, width: int, height: int) -> None:
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": False})  # fmt: skip

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)
