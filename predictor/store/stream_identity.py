"""Which Redis observation stream a URL and a namespace name, however the URL is spelt.

A model records the stream its position is in (`Store.stream_name`, under `STREAM_KEY` in its metadata), and
whoever loads it (a replica starting from --model-dir, the retraining job) goes on from that position only in the
same stream. One stream is often named in different words (``redis://h:6379`` and ``redis://h/0``): comparing
the URLs' text dropped the position of a model saved under the other spelling, and its stream was learned again,
every row twice. So every writer records one canonical name (`StreamIdentity.name`) and every reader compares
identities (`same_stream`), which also recognises the names recorded before they were canonical.

No Redis client here: the service imports this with or without Redis.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, unquote, unquote_plus, urlsplit

DEFAULT_PORT = 6379  # redis-py's, and Redis's


def split_credentials(url: str) -> tuple[str, str, str]:
    """(what comes before the user part, the user part, the rest): everything between `//` and the last `@` is
    taken as the user and password, so that one holding `/`, `?`, `#` or `@` is never taken as host or path.

    >>> split_credentials("redis://:pa/ss@10.0.0.5:6379/0"), split_credentials("redis://10.0.0.5")
    (('redis://', ':pa/ss', '10.0.0.5:6379/0'), ('redis://10.0.0.5', '', ''))
    """
    head, sep, rest = url.partition("//")
    if not sep or "@" not in rest:
        return url, "", ""
    userinfo, _, tail = rest.rpartition("@")
    return head + sep, userinfo, tail


# Query parameters of a Redis URL that carry a secret: redis-py passes every parameter on to its connection, which
# takes the user and password (a Unix socket's URL has no user part to hold them) and a TLS key file's password.
CREDENTIAL_PARAMETERS = frozenset({"username", "password", "ssl_password"})


def without_credentials(url: str) -> str:
    """A Redis URL as logs, status pages, error messages, reports and artifacts show it: its user part and its
    credential parameters (`CREDENTIAL_PARAMETERS`, named in any case or percent-encoded) left out, every other
    part as written.

    >>> without_credentials("rediss://:secret@10.0.0.5:6380/0"), without_credentials("redis://10.0.0.5:6379/0")
    ('rediss://10.0.0.5:6380/0', 'redis://10.0.0.5:6379/0')
    >>> without_credentials("redis://:Zx9/Secr#t@10.0.0.5:6379/0")
    'redis://10.0.0.5:6379/0'
    >>> without_credentials("unix:///run/redis.sock?password=secret&db=2"), without_credentials("unix:///s?Pass%77ord=x")
    ('unix:///run/redis.sock?db=2', 'unix:///s')
    """
    head, userinfo, tail = split_credentials(url)
    base, mark, query = (head + tail if userinfo else url).partition("?")  # no user part left to hold a '?'
    kept = [
        part for part in query.split("&") if unquote_plus(part.partition("=")[0]).lower() not in CREDENTIAL_PARAMETERS
    ]
    return f"{base}?{'&'.join(kept)}" if mark and any(kept) else base


def observation_stream_key(namespace: str) -> str:
    """The Redis stream the replicas of `namespace` append accepted observations to (what the retraining job
    reads as a sample source).

    >>> observation_stream_key("leadtime")
    'leadtime:observations'
    """
    return f"{namespace}:observations"


@dataclass(frozen=True)
class StreamIdentity:
    """Which observation stream a Redis URL and a namespace name, as far as the URL's text says for certain.

    A model's recorded stream, a replica's store, the retraining job's sources and registry may each name one
    stream in different words (``redis://h:6379`` and ``redis://h/0/``). Only what is certainly the same server
    and database is made one: a host name in any case, the default port (6379) and database (0), a trailing
    slash, the database given as ``?db=`` (which redis-py takes over the path); credentials and client options
    say how to connect, not where. Names are not resolved: ``localhost`` may be ``::1``, another server than
    ``127.0.0.1``; and ``rediss://`` is TLS, another listener than ``redis://``.

    >>> StreamIdentity.of("REDIS://Cache.Local/0/", "a") == StreamIdentity.of("redis://cache.local:6379", "a")
    True
    >>> StreamIdentity.of("unix:///run/redis.sock?db=2", "a")
    StreamIdentity(scheme='unix', server='/run/redis.sock', db=2, namespace='a')
    """

    scheme: str  # redis, rediss or unix
    server: str  # host:port (a host in lower case, percent-encoded as in a URL), or a Unix socket's path
    db: int
    namespace: str

    @classmethod
    def of(cls, url: str, namespace: str) -> StreamIdentity:
        """The identity of `url` (one the store's client takes: its database a number) and `namespace`;
        ValueError for a port or database that is not a number."""
        parts = urlsplit(without_credentials(url))  # a password may hold what would confuse urlsplit
        given = [value for key, value in parse_qsl(parts.query) if key == "db"]
        path = unquote(parts.path)
        if parts.scheme == "unix":
            return cls("unix", quote(path), int(given[0]) if given else 0, namespace)
        database = given[0] if given else path.replace("/", "")
        host = quote(unquote(parts.hostname or "localhost"), safe=":")  # redis-py's default host
        server = f"[{host}]" if ":" in host else host  # an IPv6 address in brackets, as in a URL
        return cls(parts.scheme, f"{server}:{parts.port or DEFAULT_PORT}", int(database) if database else 0, namespace)

    @property
    def address(self) -> str:
        """The one URL every spelling of this server and database comes to (no credentials, no client options).

        >>> StreamIdentity.of("redis://:secret@Cache.Local?socket_timeout=5", "a").address
        'redis://cache.local:6379/0'
        >>> StreamIdentity.of("unix:///run/redis.sock", "a").address, StreamIdentity.of("unix:///s?db=2", "a").address
        ('unix:///run/redis.sock', 'unix:///s?db=2')
        """
        if self.scheme == "unix":
            return f"unix://{self.server}?db={self.db}" if self.db else f"unix://{self.server}"
        return f"{self.scheme}://{self.server}/{self.db}"

    @property
    def name(self) -> str:
        """What a model records as the stream its position is in (`Store.stream_name`): the canonical address and
        the stream's key. Its address holds no space (a socket path's is percent-encoded), as the form the service
        recorded before (``<the URL as given> <stream key>``), which the common spelling
        ``redis://host:6379/0`` still matches word for word.

        >>> StreamIdentity.of("redis://127.0.0.1:6379", "leadtime").name
        'redis://127.0.0.1:6379/0 leadtime:observations'
        """
        return f"{self.address} {observation_stream_key(self.namespace)}"


def same_stream(recorded: object, ours: StreamIdentity | None) -> bool:
    """Whether `recorded` (a model's `STREAM_KEY`) names the stream `ours` (a store's `stream`; None for a stream
    no other process reads, which no recorded name is). A name is read as ``<address> <stream key>``, the
    canonical one or one recorded before names were canonical (the URL as given, without its credentials), and
    compared as the identity it names, not as text.

    >>> ours = StreamIdentity.of("redis://127.0.0.1:6379/0", "leadtime")
    >>> same_stream("redis://127.0.0.1 leadtime:observations", ours), same_stream(ours.name, ours)
    (True, True)
    >>> same_stream("redis://localhost:6379/0 leadtime:observations", ours), same_stream(None, ours)
    (False, False)
    """
    if ours is None or not isinstance(recorded, str):
        return False
    key = f" {observation_stream_key(ours.namespace)}"  # a namespace may hold a space: split where ours ends
    if not recorded.endswith(key):
        return False
    try:
        return StreamIdentity.of(recorded[: -len(key)], ours.namespace) == ours
    except ValueError:  # not an address: nothing this store's stream is
        return False
