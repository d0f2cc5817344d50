"""`trtspec serve`'s process: uvicorn on a socket bound before the model loads, its signals (a
graceful shutdown that cancels what is left, exit status 0), and a deadline on each request's head.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import signal
import socket
import threading

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from trtspec.errors import TrtspecError
from trtspec.serving.app import OpenAIServer
from trtspec.serving.frontend import short_repr


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, except that on SIGINT/SIGTERM the front end stops taking requests at once,
    and when the grace period is over the engine is closed, which cancels what is still running:
    each of those clients gets its error (a stream: an error event and [DONE]) rather than a cut
    connection. Afterwards it returns (exit status 0) instead of raising the signal again (which
    Python turns into a KeyboardInterrupt traceback for SIGINT)."""

    def __init__(self, config: uvicorn.Config, front_end: OpenAIServer, graceful_s: float):
        super().__init__(config)
        self.front_end, self.graceful_s = front_end, graceful_s

    async def shutdown(self, sockets=None) -> None:
        self.front_end.closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(self.graceful_s, lambda: loop.run_in_executor(None, self.front_end.close))
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {number: signal.signal(number, self.handle_exit) for number in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for number, handler in original.items():
                signal.signal(number, handler)


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (0: any free port), made before the model loads so that a
    port in use is refused at once. An empty host (which binds every interface without saying so)
    is refused: every interface is 0.0.0.0 or ::, named (`listens_everywhere`)."""
    if not host.strip():
        raise TrtspecError("--host is empty: give an address (127.0.0.1: this machine only; 0.0.0.0 or ::: "
                           "every interface)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, ValueError, UnicodeError) as exc:  # ValueError: a NUL; UnicodeError: not a host name
        sock.close()
        reason = getattr(exc, "strerror", None) or "not a host name or address"
        shown = host if host.isascii() and host.isprintable() else short_repr(host)
        raise TrtspecError(f"cannot listen on {shown}:{port}: {reason}") from None
    return sock


def listens_everywhere(sock: socket.socket) -> bool:
    """Whether the socket is bound to every interface (0.0.0.0, ::; also what "0" resolves to)."""
    return ipaddress.ip_address(sock.getsockname()[0].split("%")[0]).is_unspecified


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if sock.family == socket.AF_INET6 else host}:{port}"


class _HeadDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on each request's head: a connection that has not
    sent a whole head `head_timeout_s` after it opened (or after its previous response) is closed.
    uvicorn's own keep-alive timer restarts on every byte, so headers sent a byte at a time would
    hold a connection open for ever."""

    def __init__(self, *args, head_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_timeout_s, self._deadline = head_timeout_s, None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        waiting = self.cycle  # a new head replaces the cycle: then the deadline has been met

        def late() -> None:
            if self.cycle is waiting and not self.transport.is_closing():
                self.transport.close()

        self._deadline = self.loop.call_later(self.head_timeout_s, late)


def serve(server: OpenAIServer, sock: socket.socket, *, graceful_s: float = 10.0) -> None:
    """Run uvicorn on a bound socket (`listen_socket`) until SIGINT/SIGTERM. In-flight requests get
    `graceful_s` seconds to finish, then are cancelled; the engine stops last. A request's head and
    its body each have `server.read_timeout_s` to arrive; idle keep-alive connections close after 5 s."""
    # uvicorn's own deadline is a backstop: by then the closed engine has ended every request.
    config = uvicorn.Config(server.app, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=graceful_s + 10, lifespan="on", timeout_keep_alive=5,
                            h11_max_incomplete_event_size=64 * 2**10,  # a request's head: 64 KiB at most
                            http=functools.partial(_HeadDeadline, head_timeout_s=server.read_timeout_s))
    try:
        _Uvicorn(config, server, graceful_s).run(sockets=[sock])
    finally:
        sock.close()
        server.close()
