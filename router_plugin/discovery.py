"""Which endpoints exist: llm-d's file discovery (re-read when the file changes) or a static list.

The file is llm-d's format, YAML or JSON:

    endpoints:
      - name: h100-0
        namespace: serving            # optional; the endpoint's id is namespace/name when given
        address: 10.0.0.7
        port: "8000"                  # a string in llm-d's files; an integer is accepted too
        labels:
          llm-d.ai/role: both         # prefill | decode | both (default both)
          leadtime.io/accelerator: h100-sxm
          leadtime.io/timeslice-group: rl
          leadtime.io/model: llama-3.1-8b          # Leadtime's own, optional
          leadtime.io/tensor-parallel: "1"         # Leadtime's own, optional

At most 1 MiB, as llm-d reads it. A reload that finds the file missing, oversized or malformed keeps the previous
set and logs why: a bad edit never empties a running gateway's fleet. A static list (`--endpoint` on the command
line) takes `ADDRESS:PORT[,KEY=VALUE...]`, where a key is `name` or a label.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from leadtime.features.catalog import BUILT_IN, Catalog
from leadtime.features.catalog_file import CATALOG_HINT
from leadtime.features.errors import FeatureError, expected_mapping, validation_problem
from leadtime.features.rows import MAX_TENSOR_PARALLEL, ROLES, EndpointState
from leadtime.yaml_text import load_json, load_yaml, yaml_problem

log = logging.getLogger("leadtime.router.discovery")

MAX_FILE_BYTES = 1 << 20
ROLE_LABEL = "llm-d.ai/role"
ACCELERATOR_LABEL = "leadtime.io/accelerator"
TIMESLICE_LABEL = "leadtime.io/timeslice-group"
MODEL_LABEL = "leadtime.io/model"
TP_LABEL = "leadtime.io/tensor-parallel"
SCHEME_LABEL = "leadtime.io/scheme"
SCHEMES = ("http", "https")
"""How the gateway reaches an endpoint (its proxied requests and its /metrics): plain HTTP unless the endpoint's
`leadtime.io/scheme` label says https (vLLM started with --ssl-certfile/--ssl-keyfile)."""


class DiscoveryError(ValueError):
    """The endpoint list is malformed; the message names the field."""


_ADDRESS = re.compile(r"[A-Za-z0-9._:%-]{1,253}")
"""A host name, an IPv4 address or an IPv6 one (with a zone after `%`)."""


class _EndpointSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    namespace: str = ""
    address: str = Field(min_length=1)
    port: int | str
    labels: dict[str, str] = {}

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        address = value.strip()
        if address.startswith("[") and address.endswith("]"):  # an IPv6 literal as a URL writes it
            address = address[1:-1]
        if not _ADDRESS.fullmatch(address):
            raise ValueError(f"must be a host name or an IP address, got {value[:80]!r}")
        if ":" in address:  # only an IPv6 address has colons: "10.0.0.7:8000" is an address written with its port
            try:
                ipaddress.IPv6Address(address.partition("%")[0])
            except ValueError:
                raise ValueError(
                    f"must be a host name or an IP address (its port goes in `port`), got {value[:80]!r}"
                ) from None
        return address

    @field_validator("labels", mode="before")
    @classmethod
    def _labels(cls, value: object) -> object:
        """A number written unquoted in YAML (`leadtime.io/tensor-parallel: 2`) is the label's text; `labels:` with
        every label commented out (YAML's null, as JSON's `null`) is no labels, as llm-d's loader reads it."""
        if value is None:
            return {}
        if isinstance(value, dict):
            return {
                k: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for k, v in value.items()
            }
        return value

    @field_validator("port", mode="before")
    @classmethod
    def _port(cls, value: object) -> int:
        text = value.strip() if isinstance(value, str) else value
        if isinstance(text, str) and text.isascii() and text.isdigit():
            port = int(text)
        elif isinstance(value, int) and not isinstance(value, bool):
            port = value
        elif isinstance(value, float) and value.is_integer():
            port = int(value)
        else:
            raise ValueError(f"must be a port number, got {value!r}")
        if not 1 <= port <= 65535:
            raise ValueError(f"must be between 1 and 65535, got {port}")
        return port


class _FileSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    endpoints: list[_EndpointSpec]


@dataclass(frozen=True)
class DiscoveredEndpoint:
    """One endpoint as discovery describes it: where it is and what its labels say."""

    name: str
    address: str
    port: int
    namespace: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def endpoint_id(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name

    @property
    def host_port(self) -> str:
        """`address:port`, as llm-d names a prefill endpoint in `x-prefiller-host-port`."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"

    @property
    def server(self) -> tuple[str, int]:
        """(host, port) the same however the host is spelled: a name in lower case without a trailing dot (DNS names
        are case-insensitive), an IP address in its canonical form (`0:0:0:0:0:0:0:1` is `::1`, `::ffff:10.0.0.1`
        is `10.0.0.1`); an IPv6 zone, which names an interface, is kept as written."""
        address, sep, zone = self.address.partition("%")
        host = address.lower().rstrip(".")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return host + sep + zone, self.port
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip.compressed + sep + zone, self.port

    @property
    def role(self) -> str:
        return self.labels.get(ROLE_LABEL, "both") or "both"

    @property
    def tls(self) -> bool:
        """Whether the endpoint serves HTTPS (its `leadtime.io/scheme` label)."""
        return self.labels.get(SCHEME_LABEL, "http") == "https"

    @property
    def timeslice_group(self) -> str:
        return self.labels.get(TIMESLICE_LABEL, "")

    def base_state(self, default_accelerator: str = "", default_model: str = "") -> EndpointState:
        """The endpoint's identity as a feature row needs it; the load comes from scraping."""
        return EndpointState(
            endpoint_id=self.endpoint_id,
            accelerator=self.labels.get(ACCELERATOR_LABEL, default_accelerator),
            model=self.labels.get(MODEL_LABEL, default_model),
            tensor_parallel=int(self.labels.get(TP_LABEL, "1")),
            role=self.role,
            timeslice_state="resident" if self.timeslice_group else "none",
        )


EXPECTED = {
    _EndpointSpec.__name__: expected_mapping(_EndpointSpec),
    "labels": "expected a mapping of label names to values",
}
"""What a misshapen part of the file should be (`validation_problem`'s `expected`)."""


def _describe(err: ValidationError) -> str:
    where, problem = validation_problem(err, EXPECTED)
    return f"{where or 'file'}: {problem}"


LEADTIME_LABELS = (ACCELERATOR_LABEL, MODEL_LABEL, TP_LABEL, TIMESLICE_LABEL, SCHEME_LABEL)
"""Every label Leadtime reads under its own prefix; another one there is a misspelling (llm-d's and others' are
left alone)."""


def _check_labels(index: int, labels: Mapping[str, str], catalog: Catalog) -> None:
    where = f"endpoints[{index}].labels"
    for label in labels:
        if label.startswith("leadtime.io/") and label not in LEADTIME_LABELS:
            raise DiscoveryError(f"{where}.{label[:80]}: not a Leadtime label (known: {', '.join(LEADTIME_LABELS)})")
    role = labels.get(ROLE_LABEL, "both")
    if role not in ROLES:
        raise DiscoveryError(f"{where}.{ROLE_LABEL}: must be one of {', '.join(ROLES)}, got {role!r}")
    scheme = labels.get(SCHEME_LABEL, "http")
    if scheme not in SCHEMES:
        raise DiscoveryError(f"{where}.{SCHEME_LABEL}: must be one of {', '.join(SCHEMES)}, got {scheme[:20]!r}")
    tp = labels.get(TP_LABEL, "1")
    if not (tp.isascii() and tp.isdigit() and len(tp) <= 9) or not 1 <= int(tp) <= MAX_TENSOR_PARALLEL:
        raise DiscoveryError(f"{where}.{TP_LABEL}: must be an integer from 1 to {MAX_TENSOR_PARALLEL}, got {tp[:20]!r}")
    lookups: tuple[tuple[str, Callable[[str], object]], ...] = (
        (ACCELERATOR_LABEL, catalog.accelerator),
        (MODEL_LABEL, catalog.model),
    )
    for label, lookup in lookups:
        if label in labels:
            try:
                lookup(labels[label])
            except FeatureError as err:
                raise DiscoveryError(f"{where}.{label}: {err.problem}; {CATALOG_HINT}") from None


def parse_endpoints(data: object, catalog: Catalog = BUILT_IN) -> tuple[DiscoveredEndpoint, ...]:
    """A parsed YAML/JSON document → endpoints whose labels name classes and models of `catalog`; DiscoveryError
    names the offending field."""
    if not isinstance(data, dict):
        raise DiscoveryError("file: expected a mapping with an 'endpoints' list")
    try:
        spec = _FileSpec.model_validate(data)
    except ValidationError as err:
        raise DiscoveryError(_describe(err)) from None
    endpoints = []
    seen: set[str] = set()
    servers: dict[tuple[str, int], DiscoveredEndpoint] = {}  # each server → the endpoint listed there first
    for i, e in enumerate(spec.endpoints):
        _check_labels(i, e.labels, catalog)
        endpoint = DiscoveredEndpoint(e.name, e.address, int(e.port), e.namespace, dict(e.labels))
        try:  # what a feature row refuses (an id too long to be one) would leave the endpoint never scraped
            endpoint.base_state()
        except FeatureError as err:
            raise DiscoveryError(f"endpoints[{i}].name: {err.problem}") from None
        if endpoint.endpoint_id in seen:
            raise DiscoveryError(f"endpoints[{i}].name: {endpoint.endpoint_id!r} is listed twice")
        first = servers.setdefault(endpoint.server, endpoint)
        if first is not endpoint:  # one server under two names: its load would be counted twice
            spelled = "" if first.host_port == endpoint.host_port else f" (at {first.host_port})"
            raise DiscoveryError(
                f"endpoints[{i}].address: {endpoint.host_port} is endpoint {first.endpoint_id!r} already{spelled}"
            )
        seen.add(endpoint.endpoint_id)
        endpoints.append(endpoint)
    roles = {e.role for e in endpoints}
    if "both" in roles and roles & {"prefill", "decode"}:
        unified = sorted(e.endpoint_id for e in endpoints if e.role == "both")
        log.warning(
            "discovery mixes unified endpoints (%s) with prefill/decode ones: a fleet is one or the other, and "
            "the unified ones are left out while P/D endpoints can be routed to",
            ", ".join(unified[:5]) + (", ..." if len(unified) > 5 else ""),
        )
    return tuple(endpoints)


def read_watched_file(path: Path, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a file the gateway watches (discovery, time-slice states); ValueError saying after its name why
    not, on one line: missing, unreadable, larger than `max_bytes`, not a regular file. It is opened without waiting
    and its kind checked before it is read: a named pipe there was read until something wrote to it (a gateway
    given one never started, and one whose time-slice file became one froze, that file being read on its event
    loop)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise ValueError(f"{path}: {(err.strerror or str(err)).lower()}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ValueError(f"{path}: is a directory")
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path}: not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            raw = handle.read(max_bytes + 1)
    except OSError as err:
        raise ValueError(f"{path}: {(err.strerror or str(err)).lower()}") from None
    finally:
        os.close(fd)
    if len(raw) > max_bytes:
        limit = f"{max_bytes >> 20} MiB" if max_bytes % (1 << 20) == 0 else f"{max_bytes} bytes"
        raise ValueError(f"{path}: larger than {limit}")
    return raw


def read_endpoints_file(
    path: Path, max_bytes: int = MAX_FILE_BYTES, catalog: Catalog = BUILT_IN
) -> tuple[DiscoveredEndpoint, ...]:
    """Read and parse a discovery file; DiscoveryError says what is wrong with it."""
    try:
        raw = read_watched_file(path, max_bytes)
    except ValueError as err:
        raise DiscoveryError(str(err)) from None
    try:
        text = raw.decode()
        data = load_json(text) if str(path).endswith(".json") else load_yaml(text)
    except (ValueError, yaml.YAMLError) as err:  # ValueError: bad UTF-8 or JSON, an integer of thousands of digits
        raise DiscoveryError(f"{path}: not valid YAML/JSON ({yaml_problem(err)})") from None
    except RecursionError:
        raise DiscoveryError(f"{path}: not valid YAML/JSON (nested too deeply)") from None
    try:
        return parse_endpoints(data, catalog)
    except DiscoveryError as err:
        raise DiscoveryError(f"{path}: {err}") from None


def parse_static(specs: Sequence[str], catalog: Catalog = BUILT_IN) -> tuple[DiscoveredEndpoint, ...]:
    """`ADDRESS:PORT[,KEY=VALUE...]` items (KEY is `name` or a label) → endpoints.

    >>> endpoints = parse_static(["127.0.0.1:8100", "127.0.0.1:8101,name=l4,leadtime.io/accelerator=l40s"])
    >>> [(e.endpoint_id, e.base_state().accelerator) for e in endpoints]
    [('127.0.0.1:8100', ''), ('l4', 'l40s')]
    """
    entries: list[dict[str, Any]] = []
    for i, spec in enumerate(specs):
        target, *pairs = spec.split(",")
        address, sep, port = target.rpartition(":")
        if not sep or not address:
            raise DiscoveryError(f"endpoint {i + 1} ({spec!r}): expected ADDRESS:PORT[,KEY=VALUE...]")
        entry: dict[str, Any] = {"name": target, "address": address.strip("[]"), "port": port, "labels": {}}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise DiscoveryError(f"endpoint {i + 1} ({spec!r}): {pair!r} is not KEY=VALUE")
            if key == "name":
                entry["name"] = value
            else:
                entry["labels"][key] = value
        entries.append(entry)
    try:
        return parse_endpoints({"endpoints": entries}, catalog)
    except DiscoveryError as err:  # named as given, not as an entry of the list built here
        where = _STATIC_FIELD.match(str(err))
        if where is None:
            raise
        i = int(where.group(1))
        raise DiscoveryError(f"endpoint {i + 1} ({specs[i]!r}): {str(err)[where.end() :]}") from None


_STATIC_FIELD = re.compile(r"endpoints\[(\d+)\]\.(?:labels\.)?")
"""Where `parse_endpoints` says an entry of a static list is at fault: `endpoints[I].` and, for a label, `labels.`
(a static endpoint gives its labels as KEY=VALUE beside its name)."""


class StaticDiscovery:
    """A fixed endpoint list."""

    def __init__(self, endpoints: Sequence[DiscoveredEndpoint]) -> None:
        self.endpoints: tuple[DiscoveredEndpoint, ...] = tuple(endpoints)
        self.last_error: str | None = None
        self.reloads = 0
        self.failed_reloads = 0

    def poll(self) -> bool:
        """Nothing to re-read; False (unchanged)."""
        return False


def describe_change(before: Sequence[DiscoveredEndpoint], after: Sequence[DiscoveredEndpoint]) -> str:
    """What a new endpoint list changed, by name: "added c; removed a; changed b" (address, port or labels)."""
    old = {e.endpoint_id: e for e in before}
    new = {e.endpoint_id: e for e in after}
    parts = (
        ("added", [n for n in new if n not in old]),
        ("removed", [n for n in old if n not in new]),
        ("changed", [n for n in new if n in old and new[n] != old[n]]),
    )
    return "; ".join(f"{verb} {', '.join(names)}" for verb, names in parts if names) or "reordered"


class FileDiscovery:
    """llm-d file discovery: the file is re-read whenever it changes (size, mtime or inode), polled by `poll`.

    Parameters
    ----------
    path
        The YAML/JSON endpoints file.
    max_bytes
        Larger files are refused (llm-d's limit is 1 MiB).
    catalog
        The accelerator classes and models the endpoints' labels may name.

    The first read must succeed (a gateway cannot start on a broken file); later ones that fail keep the
    previous set, log the reason and count in `failed_reloads`.
    """

    def __init__(self, path: Path, max_bytes: int = MAX_FILE_BYTES, catalog: Catalog = BUILT_IN) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.catalog = catalog
        self.last_error: str | None = None
        self.reloads = 0
        self.failed_reloads = 0
        self._stamp = self._stat()
        self.endpoints: tuple[DiscoveredEndpoint, ...] = read_endpoints_file(self.path, max_bytes, catalog)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def poll(self) -> bool:
        """Re-read the file if it changed; True when the endpoint set changed."""
        stamp = self._stat()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            endpoints = read_endpoints_file(self.path, self.max_bytes, self.catalog)
        except DiscoveryError as err:
            self.failed_reloads += 1
            self.last_error = str(err)
            log.warning("discovery reload failed, keeping the previous %d endpoints: %s", len(self.endpoints), err)
            return False
        self.reloads += 1
        if self.last_error is not None and endpoints == self.endpoints:  # else the change below is said
            log.info("discovery: %s reads again (%d endpoints, as before)", self.path, len(endpoints))
        self.last_error = None
        changed = endpoints != self.endpoints
        if changed and not endpoints:
            log.warning("discovery: %s lists no endpoint; nothing can be routed until it lists some", self.path)
        elif changed:
            log.info("discovery: %d endpoints (%s)", len(endpoints), describe_change(self.endpoints, endpoints))
        self.endpoints = endpoints
        return changed
