"""Whether a server can listen where it is asked to, checked before it starts (the service, the gateway and
`leadtime sim serve` each start uvicorn, which would log a bind failure over several lines and exit 3).

The sockets are bound and let go, not handed to uvicorn: a socket made without IPPROTO_TCP (`socket.create_server`
says protocol 0) leaves Nagle's algorithm on for its connections, since asyncio sets TCP_NODELAY only on sockets
that say IPPROTO_TCP, and streamed tokens then go out in bursts.
"""

from __future__ import annotations

import socket


def host_port(host: str, port: int) -> str:
    """`host:port` as gRPC's addresses and URLs write it: an IPv6 address in brackets (gRPC cannot parse `::1:50051`,
    and `leadtime serve --host ::1` stopped at start blaming the port).

    >>> host_port("::1", 50051), host_port("127.0.0.1", 8000)
    ('[::1]:50051', '127.0.0.1:8000')
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def probe_bind(host: str, port: int) -> None:
    """Bind, and let go, every address `host` resolves to (all interfaces for "") on `port`, as asyncio's server
    would. OSError (socket.gaierror when `host` does not resolve) with `host:port` as its filename when one
    cannot be bound; port 0 (any free port) always passes."""
    if port == 0:
        return
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and gRPC bind
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as err:
        raise type(err)(err.errno, err.strerror or str(err), f"{host}:{port}") from None
    finally:
        for sock in sockets:
            sock.close()


def check_port_free(host: str, port: int, what: str) -> None:
    """Raise OSError in one line, `cannot serve WHAT on HOST:PORT: why`, when `host:port` cannot be bound
    (another process has it, the address is not this machine's, or `host` does not resolve): every server the
    CLI starts says it alike."""
    try:
        probe_bind(host, port)
    except socket.gaierror as err:
        problem = f"the address cannot be resolved ({(err.strerror or str(err)).lower()})"
        raise OSError(f"cannot serve {what} on {host_port(host, port)}: {problem}") from None
    except OSError as err:
        raise OSError(f"cannot serve {what} on {host_port(host, port)}: {(err.strerror or str(err)).lower()}") from None
