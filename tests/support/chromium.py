"""Just enough of the Chrome DevTools Protocol to read and photograph a live page.

`--dump-dom` never returns on the Temporal UI's workflow page (it keeps polling, so virtual
time never runs out); a remote-debugging session reads the rendered text whenever it is ready.
Chromium is started on 127.0.0.1 with a profile of its own and stopped by its PID.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import websockets

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# Every same-origin frame's text too: the UI renders Current Details (Markdown) in an iframe.
PAGE_TEXT = """
[document.body ? document.body.innerText : '',
 ...[...document.querySelectorAll('iframe')].map(f => {
   try { return f.contentDocument.body.innerText } catch (e) { return '' } })
].join('\\n')
"""


class Page:
    def __init__(self, ws: websockets.ClientConnection) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        # The page's console and uncaught errors, once `record_console` was called: what a
        # failing test shows about the page's own side.
        self.console: list[str] = []
        # The requests the page sent, once `record_requests` was called: each one's method,
        # URL, headers and body (`Network.requestWillBeSent`'s `request`).
        self.requests: list[dict[str, Any]] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        await self._ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(await self._ws.recv())
            if message.get("id") == call_id:
                result: dict[str, Any] = message.get("result", {})
                return result
            self._note(message)

    def _note(self, message: dict[str, Any]) -> None:
        params = message.get("params", {})
        if message.get("method") == "Runtime.consoleAPICalled":
            words = [str(arg.get("value", arg.get("description", ""))) for arg in params["args"]]
            self.console.append(f"console.{params.get('type')}: {' '.join(words)}")
        elif message.get("method") == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            thrown = details.get("exception", {}).get("description") or details.get("text")
            self.console.append(f"uncaught: {thrown}")
        elif message.get("method") == "Network.requestWillBeSent":
            self.requests.append(params["request"])
        del self.console[:-200]
        del self.requests[:-1000]

    async def record_console(self) -> None:
        """Keep the page's console messages and uncaught errors from now on (`console`)."""
        await self.call("Runtime.enable")

    async def record_requests(self) -> None:
        """Keep the requests the page sends from now on (`requests`), read as messages arrive:
        during any later call."""
        await self.call("Network.enable")

    async def evaluate(self, expression: str, await_promise: bool = False) -> Any:
        """The expression's value; with `await_promise`, what the promise it gives resolves to."""
        result = await self.call(
            "Runtime.evaluate",
            expression=expression,
            returnByValue=True,
            awaitPromise=await_promise,
        )
        return result.get("result", {}).get("value")

    async def text(self) -> str:
        return str(await self.evaluate(PAGE_TEXT) or "")

    async def click_text(self, label: str) -> None:
        """Click the links, buttons and tabs whose text is exactly `label`."""
        await self.evaluate(
            "[...document.querySelectorAll('a,button,[role=tab]')]"
            f".filter(e => e.innerText.trim() == {json.dumps(label)}).forEach(e => e.click())"
        )

    async def screenshot(self, path: Path, full_page: bool = False) -> None:
        """A PNG of the window, or with `full_page` of the whole page, scrolled part too."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = (await self.call("Page.getLayoutMetrics"))["cssContentSize"]
            clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
            params |= {"clip": clip, "captureBeyondViewport": True}
        shot = await self.call("Page.captureScreenshot", **params)
        await asyncio.to_thread(path.write_bytes, base64.b64decode(shot["data"]))

    async def wait_for(self, expression: str, timeout_s: float, every_s: float = 0.2) -> Any:
        """The first truthy value of `expression`, evaluated every `every_s`; TimeoutError
        after `timeout_s`."""
        # Polled: a page's state has no event this process could wait on.
        async with asyncio.timeout(timeout_s):
            while not (value := await self.evaluate(expression)):  # noqa: ASYNC110
                await asyncio.sleep(every_s)
        return value


@asynccontextmanager
async def open_page(url: str, port: int, profile: Path) -> AsyncIterator[Page]:
    assert CHROMIUM is not None, "no chromium installed (apt-get install chromium)"
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM,
        "--headless",
        "--no-sandbox",  # root in a container has no user namespace for the sandbox
        "--disable-gpu",
        "--no-first-run",
        f"--remote-debugging-port={port}",
        "--remote-debugging-address=127.0.0.1",
        f"--user-data-dir={profile}",
        "--window-size=1400,1000",
        url,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        ws_url = await _page_socket(port)
        async with websockets.connect(ws_url, max_size=None) as ws:
            yield Page(ws)
    finally:
        proc.kill()
        await proc.wait()


async def _page_socket(port: int) -> str:
    async with httpx.AsyncClient(trust_env=False, timeout=2.0) as http:
        for _ in range(200):
            try:
                targets = (await http.get(f"http://127.0.0.1:{port}/json")).json()
            except (httpx.HTTPError, ValueError):
                targets = []
            pages = [t for t in targets if t.get("type") == "page"]
            if pages:
                return str(pages[0]["webSocketDebuggerUrl"])
            await asyncio.sleep(0.1)
    raise RuntimeError(f"chromium's debugging port {port} never listed a page")
