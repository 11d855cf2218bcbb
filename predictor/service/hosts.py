"""Which `Host` headers a server answers (`--allowed-host`): the defence against DNS rebinding that the service and
the gateway share.

Why: a web page served from evil.example can make its own name resolve to a server's address (DNS rebinding). The
browser then sends the page's requests to that server as same-origin, so neither CORS nor the Content-Type check
stops them, and they arrive with `Host: evil.example`. A server told the names it is reached by (its Service's DNS
name, its address) refuses every other Host, and with it the rebound page.

The rules are Starlette's `TrustedHostMiddleware`'s: the Host's port is not compared, an entry `*.example.com`
matches the subdomains of example.com (not example.com itself), `*` alone matches every host. Unlike it, an IPv6
Host (`[::1]:8000`) is read as its address, names compare without regard to case or a trailing dot, and entries
are checked at start. Plain functions rather than the middleware: the gateway is a raw ASGI app, and the service
checks the Host in its own edge, before anything else it checks.

Only HTTP is checked: browsers cannot speak gRPC, so a rebound page cannot reach the gRPC port.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence

UNCHECKED_PATHS = frozenset(("/healthz", "/readyz", "/metrics"))
"""Paths answered whatever the Host: kubelet's probes and Prometheus's scrapes name the pod by its IP address, and
these paths change nothing and tell nothing a page could use to write."""

SHOWN_CHARS = 40
"""How much of a refused Host a refusal quotes (as the gateway quotes a refused header value): a client's header
may be kilobytes long, and the answer needs only enough of it to recognise it."""

_NAME = re.compile(r"[a-z0-9_.-]+")


def check_allowed_host(entry: str) -> str:
    """An `--allowed-host` entry as it is compared (lower case, no trailing dot, an IPv6 address in its short form
    and without brackets); ValueError saying what is wrong with one no Host header could match, so that a mistyped
    entry is refused at start rather than found when every request is refused.

    >>> check_allowed_host("Leadtime.Svc."), check_allowed_host("[0:0:0:0:0:0:0:1]"), check_allowed_host("*.ex.com")
    ('leadtime.svc', '::1', '*.ex.com')
    >>> check_allowed_host("localhost:8000")
    Traceback (most recent call last):
    ...
    ValueError: 'localhost:8000' has a port: give the host without it ('localhost'); ports are not compared
    """
    if not entry:
        raise ValueError("an entry is empty: give a host name or address, as clients' Host header names it")
    if not (entry.isascii() and entry.isprintable()) or " " in entry:
        raise ValueError(f"{entry[:SHOWN_CHARS]!r} has spaces, control or non-ASCII characters: give a host name")
    if "/" in entry or "://" in entry:
        raise ValueError(f"{entry!r} is not a host: give the name alone, without scheme or path (e.g. 'example.com')")
    host = entry.lower()
    if host.startswith("["):
        inside, bracket, port = host[1:].partition("]")
        if bracket and port.startswith(":"):
            raise ValueError(f"{entry!r} has a port: give the host without it ('[{inside}]'); ports are not compared")
        if not bracket or port:
            raise ValueError(f"{entry!r} is not an IPv6 address in brackets")
        host = inside
    if ":" in host:
        try:
            return ipaddress.IPv6Address(host).compressed
        except ValueError:
            name, _, port = host.rpartition(":")
            if port.isdigit() and name:
                raise ValueError(
                    f"{entry!r} has a port: give the host without it ({entry.rpartition(':')[0]!r}); ports are not "
                    "compared"
                ) from None
            raise ValueError(f"{entry!r} is neither a host name nor an IPv6 address") from None
    if host == "*":
        return host
    name = host.removeprefix("*.") if host.startswith("*.") else host
    if "*" in name:
        raise ValueError(f"{entry!r}: a wildcard is '*' alone, or '*.' before a domain (e.g. '*.example.com')")
    name = name.removesuffix(".")
    if not name or not _NAME.fullmatch(name) or ".." in name or name.startswith("."):
        raise ValueError(f"{entry!r} is not a host name (letters, digits, '-', '_' and '.')")
    return f"*.{name}" if host.startswith("*.") else name


def parse_allowed_hosts(raw: str) -> tuple[str, ...]:
    """The entries of a comma-separated list (an environment variable's value), spaces around each dropped; each
    still to be checked (`check_allowed_host`: an empty one, as `a,,b` gives, is refused there).

    >>> parse_allowed_hosts("leadtime.svc, 10.0.0.7 ,*.example.com")
    ('leadtime.svc', '10.0.0.7', '*.example.com')
    """
    return tuple(part.strip() for part in raw.split(","))


def request_host(header: str) -> str:
    """The host a `Host` header names, as `check_allowed_host` leaves an entry: port dropped, lower case, no trailing
    dot, an IPv6 address without brackets in its short form.

    >>> request_host("Example.COM:8000"), request_host("[::1]:8000"), request_host("[0::1]"), request_host("a.b.")
    ('example.com', '::1', '::1', 'a.b')
    """
    host = header.strip().lower()
    if host.startswith("["):
        inside, bracket, _ = host[1:].partition("]")
        if not bracket:
            return host  # malformed: matches no entry
        try:
            return ipaddress.IPv6Address(inside).compressed
        except ValueError:
            return inside
    return host.partition(":")[0].removesuffix(".")


def host_header(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """A request's Host header (the first), as both faces read it from their ASGI scope; None when it sent none.

    >>> host_header([(b"accept", b"*/*"), (b"host", b"gateway:8080")]), host_header([])
    ('gateway:8080', None)
    """
    for name, value in headers:
        if name.lower() == b"host":
            return bytes(value).decode("latin-1")
    return None


def host_allowed(header: str | None, allowed: Sequence[str]) -> bool:
    """Whether a request whose Host header is `header` (None or empty: it sent none) may be answered, given the
    checked entries `allowed` (`check_allowed_host`). No entries: every request, as without the option.

    >>> allowed = ("leadtime.svc", "::1", "*.example.com")
    >>> [host_allowed(h, allowed) for h in ("LEADTIME.svc:8000", "[::1]:80", "a.example.com", "example.com", None)]
    [True, True, True, False, False]
    """
    if not allowed or "*" in allowed:
        return True
    if not header:
        return False
    host = request_host(header)
    for pattern in allowed:
        if pattern.startswith("*."):
            if host.endswith(pattern[1:]):
                return True
        elif host == pattern:
            return True
    return False


def host_refusal(header: str | None) -> str:
    """Why a request with this Host header is refused (400), quoting at most `SHOWN_CHARS` of it.

    >>> host_refusal("evil.example")
    "Host 'evil.example' is not an allowed host (--allowed-host)"
    >>> len(host_refusal("x" * 10_000)) < 120
    True
    """
    if not header:
        return "the request has no Host header, and this server answers only the hosts --allowed-host names"
    shown = repr(header) if len(header) <= SHOWN_CHARS else f"{header[:SHOWN_CHARS]!r}…"
    return f"Host {shown} is not an allowed host (--allowed-host)"
