"""Who may call `nibble serve`: the Host and Origin checks that keep the web pages a user opens from
using a server on their loopback, and CORS answers for the browser front ends they allow.

A page cannot read a cross-origin reply without CORS, but it can send a "simple" request (a POST
with Content-Type text/plain, no preflight), and the server runs it all the same. A page whose DNS
name is rebound to 127.0.0.1 is even same-origin with the server, and reads the reply. So, as
ollama does since CVE-2024-28224: bound to loopback, a request must name a loopback host in its
Host header (or one the user added); and a request that carries an Origin outside the allow-list
is refused whatever its method, before any route runs. Clients that are not browsers send no
Origin. Allowed origins get Starlette's CORS answers, preflight included.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

# pages served from this machine's loopback, on any port: a front end the user runs
LOOPBACK_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?"


def is_loopback(host: str) -> bool:
    """Whether a host name or address is this machine's loopback: localhost (and any name under
    it, which browsers resolve to loopback themselves), 127.0.0.0/8, ::1."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name a Host header gives, without its port: 'a:8132' -> 'a', '[::1]:8132' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.index("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass(frozen=True)
class Callers:
    """Who may call. hosts: the Host names served beyond loopback's, or None for any (a server
    bound to another address than loopback, which the network reaches by any name); origins: the
    web origins allowed beyond loopback pages' ("*": any)."""
    hosts: frozenset[str] | None = frozenset()
    origins: frozenset[str] = frozenset()

    @classmethod
    def of(cls, bound_to: str, hosts: Iterable[str] = (), origins: Iterable[str] = ()) -> Callers:
        """The callers of a server bound to the address or name `bound_to`, with the Host names and
        origins its user added."""
        hosts = frozenset(h.strip().lower().rstrip(".") for h in hosts)
        return cls(hosts if is_loopback(bound_to) else None, frozenset(o.strip().rstrip("/").lower() for o in origins))

    def refusal(self, host: str | None, origin: str | None) -> str | None:
        """Why a request with these Host and Origin headers is refused, or None."""
        if host and self.hosts is not None:
            name = host_name(host)
            if not (is_loopback(name) or name in self.hosts):
                return (f"this server answers requests to localhost, not to the host '{name}' "
                        f"(nibble serve --allowed-hosts {name} adds it)")
        if origin is not None and not self.origin_allowed(origin):
            return (f"requests from web pages at '{origin}' are refused "
                    f"(nibble serve --cors-origins {origin} allows them)")
        return None

    def origin_allowed(self, origin: str) -> bool:
        origin = origin.lower()
        return "*" in self.origins or origin in self.origins or re.fullmatch(LOOPBACK_ORIGINS, origin) is not None


class Guard:
    """ASGI middleware: requests that Callers refuse get `refuse(scope, why)`'s response (the API's
    error shape, 403); the rest go on through Starlette's CORS middleware to the app."""

    def __init__(self, app: ASGIApp, callers: Callers, refuse: Callable[[Scope, str], Response]):
        self.callers, self.refuse = callers, refuse
        self.app = CORSMiddleware(app, allow_origins=["*"] if "*" in callers.origins else sorted(callers.origins),
                                  allow_origin_regex=LOOPBACK_ORIGINS, allow_methods=["*"], allow_headers=["*"],
                                  max_age=600)

    async def __call__(self, scope: Scope, receive: Receive, send: Send):
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            why = self.callers.refusal(headers.get("host"), headers.get("origin"))
            if why is not None:
                await self.refuse(scope, why)(scope, receive, send)
                return
        await self.app(scope, receive, send)
