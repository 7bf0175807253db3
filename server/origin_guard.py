"""What keeps a web page the user opens from driving a local server: a server bound to loopback
answers only requests whose `Host` names a loopback host (a page on a name that DNS rebinding
pointed at 127.0.0.1 sends its own name), or one of `--allowed-hosts`; and a request body must be
JSON (checked where bodies are read: `server.handlers.read_json`), since a cross-site
form or `text/plain` fetch needs no CORS preflight and JSON does."""

from __future__ import annotations

import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

from server.handlers import error_response
from server.request_errors import ProtocolError

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def is_loopback(host: str) -> bool:
    """Whether a host name or address names this machine's loopback interface."""
    name = host.strip("[]").lower().rstrip(".")
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name of a Host header, without its port ('[::1]:8000' -> '::1')."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class OriginGuardMiddleware:
    """`bind`: the address the server listens on; `allowed_hosts`: Host names answered besides the
    loopback ones of a loopback bind (with them set, any bind checks the Host)."""

    def __init__(self, app: ASGIApp, bind: str, allowed_hosts: tuple[str, ...] = ()) -> None:
        self.app = app
        self.check_host = is_loopback(bind) or bool(allowed_hosts)
        self.loopback = is_loopback(bind)
        self.allowed = frozenset(host_name(h).lower().rstrip(".") for h in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self._refused(scope)
            if refused is not None:
                await error_response(refused)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refused(self, scope: Scope) -> ProtocolError | None:
        headers = dict(scope["headers"])
        if self.check_host:
            name = host_name(headers.get(b"host", b"").decode("latin-1")).lower().rstrip(".")
            if not ((self.loopback and is_loopback(name)) or name in self.allowed):
                return ProtocolError(
                    f"Host '{name[:64]}' is not served here: a server bound to loopback answers "
                    "loopback names only (--allowed-hosts adds others)",
                    status=421,
                    code="host_not_allowed",
                )
        return None
