"""Keys and tokens clients show as `Authorization: Bearer KEY`, checked alike wherever one is given: the service's
`--api-token`, the gateway's `--api-key` and `--api-token`.

Why one check: `LEADTIME_ROUTE_API_KEY` lists several keys (rotation), apart by commas, as the allowed-hosts
variables list their entries, or by spaces, as the README first said. `key1,key2` was taken as one key holding a
comma, and clients showing key1 or key2 got 401, with nothing said at start. No key or token may hold a
separator, so that a list given where one token is taken (`LEADTIME_API_TOKEN=t1,t2`) is refused rather than
read as one token no client shows.
"""

from __future__ import annotations

KEY_RULE = "must be printable ASCII, without spaces, commas, line breaks or control characters, not empty"


def check_key(key: str) -> str:
    """`key` as given; ValueError (`KEY_RULE`) for one a client could not send, or a list taken for one key.

    >>> check_key("s3cret")
    's3cret'
    >>> check_key("k1,k2")
    Traceback (most recent call last):
    ...
    ValueError: must be printable ASCII, without spaces, commas, line breaks or control characters, not empty
    """
    if not key or not (key.isascii() and key.isprintable()) or " " in key or "," in key:
        raise ValueError(KEY_RULE)
    return key


def parse_keys(raw: str) -> tuple[str, ...]:
    """The keys an environment variable lists, apart by commas or whitespace; an empty entry (`k1,,k2`, a trailing
    comma) is kept, for `check_key` to refuse as the allowed hosts' empty entry is.

    >>> parse_keys("k-old, k-new"), parse_keys("k-old k-new"), parse_keys("k1,")
    (('k-old', 'k-new'), ('k-old', 'k-new'), ('k1', ''))
    """
    keys: list[str] = []
    for part in raw.split(","):
        keys.extend(part.split() or [""])
    return tuple(keys)
