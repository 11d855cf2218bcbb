"""Time-slice group states for a gateway: read from a file or polled from an orchestrator's HTTP endpoint.

Both carry the same document, YAML or JSON:

    groups:
      rl:
        state: LOCKED            # IDLE | IDLE_YIELDED | LOCKED | SWITCHING
        active_job: training
        loaded_job: training
        waiters: 1
        since: 1764612345.25     # when the group entered this state, seconds since the epoch
    now: 1764612348.75           # optional: the orchestrator's clock as it wrote the document

`since` and `now` are seconds since the epoch, or milliseconds (a number beyond 2e10 is milliseconds, as
timestamps are read everywhere here); one before 2000-01-01 is refused, naming it, but for a `since` of 0 (or
none), which means not known and is taken as now. With `now`, how long a group has been in its state is
`now - since`, both on the orchestrator's clock, whatever the skew between its clock and the router's; without it,
it is the router's wall clock less `since`, which an orchestrator's clock running behind makes too long (and one
running ahead too short, down to 0). Either way the result lands on the router's monotonic clock when the document
is read. `leadtime sim serve` publishes its time-sliced fleet's groups in this form, `now` included. A document
that cannot be read or parsed keeps the previous states (and is counted), as discovery does.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from leadtime.features.errors import FeatureError, expected_mapping, validation_problem
from leadtime.features.rows import parse_timestamp
from leadtime.predictor.store.stream_identity import split_credentials
from leadtime.router_plugin.discovery import MAX_FILE_BYTES, read_watched_file
from leadtime.router_plugin.gateway.upstream import UpstreamError, Upstreams
from leadtime.router_plugin.scrape import read_at_most
from leadtime.router_plugin.timeslice import GROUP_STATES, GroupStatus
from leadtime.yaml_text import load_json, load_yaml, yaml_problem

log = logging.getLogger("leadtime.router.timeslice")


class TimesliceError(ValueError):
    """A group-state document is malformed; the message names the field."""


class _GroupSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    state: str
    active_job: str = ""
    loaded_job: str = ""
    waiters: int = Field(default=0, ge=0)
    since: float | None = None


class _Document(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    groups: dict[str, _GroupSpec]
    now: float | None = None


EXPECTED = {
    _GroupSpec.__name__: expected_mapping(_GroupSpec),
    "groups": "expected a mapping of group names to their states",
}
"""What a misshapen part of the document should be (`validation_problem`'s `expected`)."""

_EARLIEST_S = 946_684_800.0  # 2000-01-01T00:00:00Z


def _epoch_time(value: float, where: str) -> float:
    """`value` (seconds since the epoch, or milliseconds beyond 2e10) in seconds; TimesliceError naming `where`
    for a time before 2000, which no orchestrator means (a duration, a count, a clock unset).

    >>> _epoch_time(1_764_612_345_250, "since")
    1764612345.25
    >>> _epoch_time(1.0, "since")
    Traceback (most recent call last):
    ...
    leadtime.router_plugin.timeslice_sources.TimesliceError: since: must be seconds (or milliseconds) since the \
epoch, from 2000-01-01 on, got 1.0
    """
    try:
        seconds = parse_timestamp(value)
    except FeatureError as err:
        raise TimesliceError(f"{where}: {err.problem}") from None
    if seconds < _EARLIEST_S:
        raise TimesliceError(
            f"{where}: must be seconds (or milliseconds) since the epoch, from 2000-01-01 on, got {value}"
        )
    return seconds


_KINDS = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true or false"}


def parse_groups(data: object, router_now_ms: float, wall_now_s: float) -> dict[str, GroupStatus]:
    """A parsed document → statuses with `since_ms` on the router's clock."""
    if data is None:
        raise TimesliceError("the document is empty")
    if not isinstance(data, dict):
        raise TimesliceError(f"document: must be a mapping with 'groups', got {_KINDS.get(type(data), 'a value')}")
    try:
        doc = _Document.model_validate(data)
    except ValidationError as err:
        where, problem = validation_problem(err, EXPECTED)
        raise TimesliceError(f"{where or 'document'}: {problem}") from None
    # how long ago each `since` was is reckoned on the orchestrator's clock when the document says what it read
    now_s = wall_now_s if doc.now is None else _epoch_time(doc.now, "now")
    out = {}
    for name, g in doc.groups.items():
        if g.state not in GROUP_STATES:
            raise TimesliceError(f"groups.{name}.state: must be one of {', '.join(GROUP_STATES)}, got {g.state!r}")
        since_ms = router_now_ms
        if g.since:  # absent, or 0 (an orchestrator's zero value): not known, taken as now
            since_ms -= max(0.0, now_s - _epoch_time(g.since, f"groups.{name}.since")) * 1e3
        out[name] = GroupStatus(g.state, g.active_job, g.loaded_job, g.waiters, since_ms)
    return out


def unknown_keys(data: object) -> list[str]:
    """Keys of a group-state document that mean nothing here, as `groups.NAME.KEY` (or `KEY` at the top): left
    for what an orchestrator may add, but a misspelled one (`activ_job`) would change what a group serves.

    >>> unknown_keys({"groups": {"rl": {"state": "IDLE", "activ_job": "x"}}, "updated": 3})
    ['updated', 'groups.rl.activ_job']
    """
    if not isinstance(data, dict):
        return []
    out = [str(key) for key in data if key not in _Document.model_fields]
    groups = data.get("groups")
    for name, spec in groups.items() if isinstance(groups, dict) else ():
        if isinstance(spec, dict):
            out.extend(f"groups.{name}.{key}" for key in spec if key not in _GroupSpec.model_fields)
    return out


def _load(text: str) -> object:
    try:
        return load_json(text)
    except (ValueError, RecursionError):  # YAML's loader says where (a key given twice too)
        pass
    try:
        return load_yaml(text)
    except (yaml.YAMLError, ValueError) as err:  # ValueError: an integer of thousands of digits
        raise TimesliceError(f"not valid YAML/JSON ({yaml_problem(err)})") from None
    except RecursionError:
        raise TimesliceError("not valid YAML/JSON (nested too deeply)") from None


class _Source:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.groups: dict[str, GroupStatus] = {}
        self.updated_ms: float | None = None
        self.confirmed_ms: float | None = None
        """When the states were last read, or found unchanged (a file whose stamp has not moved): how old the
        states routed on are is the time since (`leadtime_router_timeslice_states_age_seconds`)."""
        self.errors = 0
        self.last_error: str | None = None
        self._warned_keys: set[str] = set()
        self._strict = False  # a failed read raises TimesliceError rather than keeping the previous states

    def status(self, group: str) -> GroupStatus | None:
        return self.groups.get(group)

    def _apply(self, raw: bytes, where: str) -> None:
        try:
            data = _load(raw.decode())
            groups = parse_groups(data, self.clock(), time.time())
        except UnicodeDecodeError as err:
            self._failed(f"{where}: not valid YAML/JSON ({err})")
            return
        except TimesliceError as err:
            self._failed(f"{where}: {err}")
            return
        # A group whose state did not change keeps the `since` first seen (the document's may drift by a poll).
        for name, status in groups.items():
            old = self.groups.get(name)
            if old is not None and (old.state, old.active_job, old.loaded_job) == (
                status.state,
                status.active_job,
                status.loaded_job,
            ):
                groups[name] = GroupStatus(
                    status.state, status.active_job, status.loaded_job, status.waiters, old.since_ms
                )
        self.groups = groups
        self.updated_ms = self.confirmed_ms = self.clock()
        if self.last_error is not None:
            log.info("time-slice states: %s read again", where)
        self.last_error = None
        for key in unknown_keys(data):
            name = key.rsplit(".", 1)[-1]
            if name not in self._warned_keys:
                self._warned_keys.add(name)
                known = ", ".join(_GroupSpec.model_fields if "." in key else _Document.model_fields)
                log.warning("time-slice states: %s: unknown key, ignored (known: %s)", key, known)

    def routing_on(self) -> str:
        """What routing goes on while the states cannot be read: the last ones read, or, none read yet, every group
        taken as away (the gateway's `_group_state`); said in the log and in /readyz."""
        if self.updated_ms is None:
            return "none read yet: every group is taken as away until they are"
        return "routing on the last states read"

    def _failed(self, message: str) -> None:
        if self._strict:
            raise TimesliceError(message)
        self.errors += 1
        if self.last_error != message:
            log.warning("time-slice states: %s (%s)", message, self.routing_on())
        self.last_error = message


class FileTimesliceSource(_Source):
    """Group states from a file, re-read when it changes (`poll`)."""

    def __init__(self, path: Path, clock: Callable[[], float]) -> None:
        super().__init__(clock)
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None

    def first_read(self) -> None:
        """Read the file at start, or TimesliceError saying why not (unreadable, of the wrong shape), as a
        discovery file is; later reads that fail keep the states read last (`poll`). A file not there yet is
        waited for, not refused: an orchestrator's sidecar writing it may start with the router (refused, the pod
        would loop), and until it is read every group is taken as away (the gateway's `_group_state`; said once, by
        `poll`)."""
        if not self.path.exists():
            self.poll()
            return
        self._strict = True
        try:
            self.poll()
        finally:
            self._strict = False

    def poll(self) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                if self.last_error is None:  # unchanged since a good read: still what the file says
                    self.confirmed_ms = self.clock()
                return
            raw = read_watched_file(self.path)  # as discovery: at most 1 MiB, a regular file
        except OSError as err:
            self._failed(f"{self.path}: {(err.strerror or str(err)).lower()}")
            return
        except ValueError as err:
            self._failed(str(err))
            return
        self._stamp = stamp
        self._apply(raw, str(self.path))


class HttpTimesliceSource(_Source):
    """Group states polled from an HTTP or HTTPS endpoint (GET, the document above as the body)."""

    def __init__(self, url: str, upstreams: Upstreams, clock: Callable[[], float], timeout_s: float = 1.0) -> None:
        super().__init__(clock)
        head, userinfo, tail = split_credentials(url)
        if userinfo:  # named without them: the URL is in every log line and in /readyz, which answers anyone
            raise TimesliceError(
                f"{head + tail!r}: a user or password in the URL is not sent (the states are read without one); "
                "give the URL without it"
            )
        try:
            parts = urlsplit(url)
            port = parts.port  # a port that is not a number from 0 to 65535 raises
        except ValueError as err:
            raise TimesliceError(f"{url!r}: expected http(s)://HOST[:PORT]/PATH ({err})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
            raise TimesliceError(f"{url!r}: expected http(s)://HOST[:PORT]/PATH")
        self.url = url
        self.host = parts.hostname
        self.tls = parts.scheme == "https"  # verified as the endpoints are: --upstream-ca, else the system's CAs
        self.port = port or (443 if self.tls else 80)
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.upstreams = upstreams
        self.timeout_s = timeout_s

    async def poll(self) -> None:
        try:
            response = await self.upstreams.pool(self.host, self.port, self.tls).request(
                "GET", self.path, timeout_s=self.timeout_s
            )
            body = await read_at_most(response, MAX_FILE_BYTES, self.timeout_s, "the time-slice document")
        except UpstreamError as err:
            self._failed(f"{self.url}: {err}")
            return
        if response.status != 200:
            self._failed(f"{self.url} answered {response.status}")
            return
        self._apply(body, self.url)
