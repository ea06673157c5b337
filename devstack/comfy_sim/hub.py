"""WebSocket sessions and event delivery, as ComfyUI's PromptServer does it.

Events are queued by `send_sync` and delivered in order by one publisher task; `sid=None`
broadcasts to every socket. Sessions are keyed by clientId: a new socket with the same ID
replaces the old one in the routing table (the old one stays open and gets nothing), and when
any socket of an ID closes, the ID is unregistered — even if a newer socket had taken it over.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

log = structlog.get_logger("comfy_sim.hub")
_Message = tuple[str, dict[str, Any], str | None]


@dataclass
class Session:
    sid: str
    ws: web.WebSocketResponse
    transport: asyncio.Transport | None


@dataclass
class _Watch:
    """Counts events reaching one prompt's socket, to trigger the drop/stall faults."""

    sid: str | None
    sent: int = 0
    drop_after: int | None = None
    stall_s: float | None = None
    stall_after: int = 1


class Hub:
    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        # Events, and fault (re)arming actions that must take effect between two events.
        self._outbox: asyncio.Queue[_Message | Callable[[], None]] = asyncio.Queue()
        self._watch: _Watch | None = None
        self._stall_until = 0.0

    # -- sending ---------------------------------------------------------------------------
    def send_sync(self, event: str, data: dict[str, Any], sid: str | None = None) -> None:
        self._outbox.put_nowait((event, data, sid))

    async def send_now(self, session: Session, event: str, data: dict[str, Any]) -> None:
        """Direct send (the greeting on connect), bypassing the outbox and the faults."""
        await self._deliver(session, json.dumps({"type": event, "data": data}))

    async def drain(self) -> None:
        """Wait until every queued event was handed to the sockets (tests, shutdown)."""
        await self._outbox.join()

    async def publish_forever(self) -> None:
        while True:
            entry = await self._outbox.get()
            try:
                if callable(entry):
                    entry()
                else:
                    await self._publish(*entry)
            except Exception:
                # A send failure must not silence every later event (ComfyUI logs and goes on).
                log.exception("websocket publish failed")
            finally:
                self._outbox.task_done()

    async def _publish(self, event: str, data: dict[str, Any], sid: str | None) -> None:
        if time.monotonic() < self._stall_until:
            return  # a stalled network: the event is lost
        message = json.dumps({"type": event, "data": data})
        if sid is None:
            targets = list(self.sessions.values())
        else:
            session = self.sessions.get(sid)
            targets = [] if session is None else [session]
        for session in targets:
            await self._deliver(session, message)
            self._count(session)

    async def _deliver(self, session: Session, message: str) -> None:
        try:
            await session.ws.send_str(message)
        except (ConnectionError, RuntimeError) as err:
            # ComfyUI logs send errors and carries on (send_socket_catch_exception).
            log.warning("send error", sid=session.sid, error=str(err))

    # -- faults ----------------------------------------------------------------------------
    def watch_prompt(
        self, sid: str | None, drop_after: int | None, stall_s: float | None, stall_after: int
    ) -> None:
        """Arm the drop/stall faults for one prompt, in order with its events: counting starts
        with the next event queued (the prompt's execution_start)."""

        def arm() -> None:
            if drop_after is None and stall_s is None:
                self._watch = None
                return
            self._watch = _Watch(sid, 0, drop_after, stall_s, stall_after)
            if stall_s is not None and (sid is None or stall_after == 0):
                self._begin_stall(stall_s)

        self._outbox.put_nowait(arm)

    def _begin_stall(self, seconds: float) -> None:
        log.info("fault: stalling websocket delivery", seconds=seconds)
        self._stall_until = time.monotonic() + seconds
        if self._watch is not None:
            self._watch.stall_s = None

    def _count(self, session: Session) -> None:
        watch = self._watch
        if watch is None or watch.sid != session.sid:
            return
        watch.sent += 1
        if watch.stall_s is not None and watch.sent >= watch.stall_after:
            self._begin_stall(watch.stall_s)
        if watch.drop_after is not None and watch.sent >= watch.drop_after:
            log.info("fault: dropping websocket", sid=session.sid, after_events=watch.sent)
            watch.drop_after = None
            if session.transport is not None:
                session.transport.abort()
        if watch.stall_s is None and watch.drop_after is None:
            self._watch = None

    def reset_faults(self) -> None:
        self._watch = None
        self._stall_until = 0.0
