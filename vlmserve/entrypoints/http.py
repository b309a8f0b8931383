"""The HTTP server under `vlmserve serve` and `vlmserve ui`: uvicorn, hardened against
slow and idle clients, with a request-body cap enforced while the body streams in and a
graceful shutdown that ends whatever is still running at its deadline with an error.

- headers must arrive within `header_timeout` of a connection's start (or of the end of
  its previous response): a client that connects and sends nothing, or drips its
  headers, is disconnected;
- a body must arrive within `body_timeout` of its headers (408), and is cut off with a
  413 as soon as it passes `max_body_bytes`, whether its length was declared or chunked;
- at most `max_connections` requests are served at once (503 beyond, in OpenAI's format);
- Ctrl-C / SIGTERM: new connections are refused, requests in flight get `drain_timeout`
  seconds to finish; then `on_drain_deadline` ends the rest (the engine aborts them with
  an error, which each stream sends as its last event before `[DONE]`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


@dataclass
class HTTPLimits:
    max_body_bytes: int = 64 << 20
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 1024
    drain_timeout: float = 30.0


LINGER_SECONDS = 2.0
Authorizer = Callable[[str, dict[bytes, bytes]], "str | None"]


class _LingeringTransport:
    """The connection's transport, except that closing it while the client is still
    sending a body (an answer before the whole body, e.g. a 413) first half-closes it
    and drops what still arrives for a moment: closing at once would reset the
    connection, and the client's network stack would throw the answer away unread."""

    def __init__(self, transport, protocol: GuardedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def close(self) -> None:
        t, p = self._transport, self._protocol
        if p.conn.their_state is h11.SEND_BODY and not t.is_closing() and t.can_write_eof() and not p.lingering:
            p.lingering = True
            t.write_eof()
            t.resume_reading()
            p.loop.call_later(LINGER_SECONDS, t.close)
        else:
            t.close()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for each request's headers and a
    lingering close."""

    header_timeout = 10.0  # set per server by make_server

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.lingering = False
        super().connection_made(_LingeringTransport(transport, self))
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the rest of a body that was answered already: dropped
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are in
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()  # the next request on this connection has the same deadline

    def connection_lost(self, exc) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class RequestGuard:
    """ASGI middleware: caps the requests served at once, reads each request's body up
    to the cap and within the time limit, then hands it to the app (from memory)."""

    def __init__(self, app, limits: HTTPLimits, unauthorized: Authorizer | None = None) -> None:
        self.app = app
        self.limits = limits
        self.unauthorized = unauthorized
        self.active = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.active >= self.limits.max_connections:
            return await _error(send, 503, f"the server is serving {self.active} requests, its limit; try again")
        self.active += 1
        try:
            await self._guarded(scope, receive, send)
        finally:
            self.active -= 1

    async def _guarded(self, scope, receive, send) -> None:
        headers = dict(scope["headers"])
        denied = self.unauthorized(scope["path"], headers) if self.unauthorized else None
        if denied:  # before a byte of the body is read
            return await _error(send, 401, denied, code="invalid_api_key")
        cap = self.limits.max_body_bytes
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > cap:
            return await _error(send, 413, f"request body is {int(declared)} bytes, over the {cap}-byte limit")
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                return await _error(send, 408, f"the request body did not arrive within "
                                               f"{self.limits.body_timeout:g} s")
            if message["type"] == "http.disconnect":
                logger.info("client %s left while sending its request", _client(scope))
                return
            size += len(message.get("body", b""))
            if size > cap:
                return await _error(send, 413, f"request body is over the {cap}-byte limit")
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only a disconnect can come

        await self.app(scope, replay, send)


async def _error(send, status: int, message: str, code: str | None = None) -> None:
    from vlmserve.entrypoints.openai.protocol import OpenAIError

    body = json.dumps(OpenAIError(status, message, code=code).body()).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def _client(scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "?"


class _DrainingServer(uvicorn.Server):
    """On the first Ctrl-C / SIGTERM, starts the drain clock."""

    def __init__(self, config: uvicorn.Config, drain_timeout: float, on_drain_deadline: Callable[[], None]) -> None:
        super().__init__(config)
        self.drain_timeout = drain_timeout
        self.on_drain_deadline = on_drain_deadline
        self._timer: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        if self._timer is None:
            logger.info("shutting down: requests in flight have %g s to finish", self.drain_timeout)
            self._timer = threading.Timer(self.drain_timeout, self.on_drain_deadline)
            self._timer.daemon = True
            self._timer.start()
        super().handle_exit(sig, frame)

    def stop_now(self) -> None:
        """Ends serving from any thread (the engine died)."""
        self.should_exit = True


def make_server(app, host: str, port: int, log_level: str, limits: HTTPLimits,
                on_drain_deadline: Callable[[], None], unauthorized: Authorizer | None = None) -> _DrainingServer:
    """unauthorized(path, headers): why a request is refused a 401 before its body is read,
    or None."""
    protocol = type("Protocol", (GuardedH11Protocol,), {"header_timeout": limits.header_timeout})
    config = uvicorn.Config(
        RequestGuard(app, limits, unauthorized), host=host, port=port, log_level=log_level.lower(), http=protocol,
        timeout_keep_alive=int(limits.keep_alive_timeout),
        # uvicorn cancels what is left a little after the drain deadline has ended it
        timeout_graceful_shutdown=int(limits.drain_timeout) + 5,
    )
    return _DrainingServer(config, limits.drain_timeout, on_drain_deadline)
