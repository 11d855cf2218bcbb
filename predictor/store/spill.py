"""Accepted observations a stopping replica could not hand to Redis, kept in a directory it owns (--model-dir).

A replica answers 202 for a row before Redis has it: during an outage the row waits in the store's memory
buffer. A clean stop (SIGTERM, a rolling update) before Redis returns lost every such row. With a directory of its
own the store writes them to a file there instead (`write_spill`), and the next store started with that directory
reads them back (`read_spills`) and sends them before anything else, oldest file first, each file's rows in order.

Exactly once: each file has an id, and its rows are sent in chunks of a fixed size cut from its start, each chunk
under the id `<file id>:<chunk number>` (`Spill.chunk_id`). Redis keeps a mark of every chunk id it took (the
store's append script), so a file read again after a crash that came before it was removed (the removal comes
only once Redis has taken every chunk) has the chunks that had landed skipped, not added twice. The marks of these
chunks are kept for `SPILL_MARK_TTL_S`; a Redis that restarted without persistence has lost the rows and the marks
alike, and gets them again.

A chunk the store was sending as it stopped (a timeout: Redis hung, or the network dropped its answer) may have
landed all the same, under the writer's own chunk id: the file records that id and the chunk's size, and its first
chunk is sent again as that chunk, under that id, so that Redis skips it if it took it (`Spill.head`). The writer's
marks last `_CHUNK_MARK_TTL_S` (the store's), so a next start within that is sure to send none of its rows twice.

One file per stop, never appended to or rewritten: a file still being sent when the store stops again is left as
it is (its chunks stay where they were), and what waits behind it goes to a new file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("leadtime.store")

SPILL_PREFIX = "unsent-observations-"
SPILL_SUFFIX = ".jsonl"
SPILL_MARK_TTL_S = 7 * 24 * 3600
"""How long Redis remembers a kept chunk it took: a replica restarted within this after a crash sends none twice."""
_HEADER_KIND = "leadtime unsent observations"


@dataclass
class Spill:
    """One file of kept rows, and how far the store has sent it."""

    path: Path
    id: str
    rows: deque[bytes]  # those not taken by Redis yet, in order
    total: int  # rows in the file
    chunks_sent: int = 0
    head: tuple[str, int] | None = None  # (id, rows) of the chunk in flight when the file was written

    def chunk_id(self) -> str:
        """The id of the next chunk to send: its place in the file, the same however often the file is read; the
        first, when the file began with a chunk in flight, under the id it was sent with."""
        if self.head is not None and self.chunks_sent == 0:
            return self.head[0]
        return f"{self.id}:{self.chunks_sent}"

    def chunk_size(self, size: int) -> int:
        """How many rows the next chunk takes: `size`, but the first as many as the chunk in flight held, so that
        its rows are the same, for Redis to skip if it took them."""
        if self.head is not None and self.chunks_sent == 0:
            return self.head[1]
        return size


def write_spill(directory: Path, rows: Sequence[bytes], head: tuple[str, int] | None = None) -> Path:
    """Write `rows` (each an observation's compact JSON, no newline) to a new file in `directory`, atomically and
    synced (a reader never sees half a file; a power cut leaves it whole or absent); its path. Files sort by the
    time they were written, so that an older stop's rows are sent first. `head`: the id and size of the chunk that
    was in flight, the first rows (`Spill.head`)."""
    spill_id = uuid.uuid4().hex
    path = directory / f"{SPILL_PREFIX}{time.time_ns():020d}-{spill_id}{SPILL_SUFFIX}"
    fields: dict[str, object] = {"kind": _HEADER_KIND, "id": spill_id, "rows": len(rows)}
    if head is not None and 0 < head[1] <= len(rows):
        fields["head"] = {"id": head[0], "rows": head[1]}
    header = json.dumps(fields).encode()
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".unsent-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header + b"\n")
            for row in rows:
                f.write(row + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    with contextlib.suppress(
        OSError
    ):  # the rename itself on disk; a directory that cannot be synced still has the file
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def read_spills(directory: Path) -> list[Spill]:
    """The files of kept rows in `directory`, oldest first, each with its rows. A file that is not one (cut short,
    or written by something else) is renamed aside with `.refused` and named in the log: its rows cannot be
    trusted to be whole."""
    spills: list[Spill] = []
    for path in sorted(directory.glob(f"{SPILL_PREFIX}*{SPILL_SUFFIX}")):
        try:
            lines = path.read_bytes().split(b"\n")
            header = json.loads(lines[0])
            rows = [line for line in lines[1:] if line]
            if header.get("kind") != _HEADER_KIND or header.get("rows") != len(rows) or lines[-1] != b"":
                raise ValueError("not a whole file of kept observations")
            spill_id = str(header["id"])
            head = _head(header.get("head"), len(rows))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            aside = path.with_name(path.name + ".refused")
            with contextlib.suppress(OSError):
                path.rename(aside)
            log.warning("ignoring %s (%s): moved aside as %s, its rows not sent", path, err, aside.name)
            continue
        spills.append(Spill(path, spill_id, deque(rows), len(rows), head=head))
    return spills


def _head(raw: object, rows: int) -> tuple[str, int] | None:
    """A header's `head` (the chunk in flight when the file was written) as `Spill.head`; ValueError for one that
    names no chunk of the file's rows."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("id"), str) or not raw["id"]:
        raise ValueError("its chunk in flight has no id")
    size = raw.get("rows")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= rows:
        raise ValueError("its chunk in flight is not a part of its rows")
    return raw["id"], size


def remove_spill(spill: Spill) -> None:
    """Redis took every row of `spill`: its file goes (a file already gone, another replica sharing the directory
    sent it too, is no error: the chunk marks kept the rows from landing twice)."""
    try:
        spill.path.unlink(missing_ok=True)
    except OSError as err:
        log.warning(
            "could not remove %s, whose rows Redis has taken: %s (sent again they are skipped)", spill.path, err
        )
