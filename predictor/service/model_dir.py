"""The `--model-dir` file, shared with whoever else writes there (`leadtime retrain --registry DIR`).

The service loads the directory's model at start and saves its own there every minute while it learns, when it
publishes one and when it stops.
Another process may publish there meanwhile; its model must not be overwritten by an older lineage, so the
service remembers what the file held when it last read or wrote it, and treats a change it did not make as a
publication to take up (see `ServiceRuntime.sync_model_dir`), not as a file to write over.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from leadtime.predictor.artifact import FILE_NAME, ArtifactError, decode, load_file, save_file

log = logging.getLogger("leadtime.service")

Stamp = tuple[int, int, int]


def _stamp(path: Path) -> Stamp | None:
    """What tells a rewrite cheaply: inode, size and modification time (None: no file)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


@dataclass(frozen=True)
class Read:
    """Bytes read from the file, and the stamp of the file they were read from (the same open file: a writer
    replaces it by a rename, so a later stat could describe newer bytes)."""

    data: bytes
    stamp: Stamp


class ModelDirFile:
    """The artifact file in a model directory, and what this process last knew it to hold.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> f = ModelDirFile(d)
    >>> f.note_current(); f.save(b"ours"), f.changed()
    (True, None)
    >>> _ = save_file(d, b"theirs")  # another process publishes
    >>> read = f.changed(); read.data, f.save(b"ours again")
    (b'theirs', False)
    >>> f.note(read); f.save(b"ours, from theirs")
    True
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / FILE_NAME
        self._lock = threading.Lock()
        self._stamp: Stamp | None = None
        self._digest: str | None = None
        self._refused: Stamp | None = None  # the stamp of a file this build refused (`note_refused`)

    def note_current(self) -> None:
        """Take what the file holds now as known (at start: whatever is there is the starting point)."""
        with self._lock:
            self._stamp = _stamp(self.path)
            self._digest = _digest_of(self.path) if self._stamp is not None else None

    def note(self, read: Read) -> None:
        """What `changed` read is known to this process (taken up or refused). Recorded with the stamp of the file
        it was read from, not the file's stamp now: one written since is still a change, taken up next."""
        with self._lock:
            self._stamp = read.stamp
            self._digest = hashlib.sha256(read.data).hexdigest()

    def note_refused(self) -> None:
        """The file noted last was refused (a newer build's artifact after a rollback, one altered since it was
        saved): the first `save` moves it aside (`set_aside`) rather than write over it. Left in place until then,
        so that the build it belongs to still finds it if nothing was saved meanwhile."""
        with self._lock:
            self._refused = self._stamp

    def changed(self) -> Read | None:
        """The file's bytes (and their stamp) if another process wrote them since this one last read or wrote it,
        else None."""
        with self._lock:
            return self._changed()

    def save(self, data: bytes) -> bool:
        """Write `data` unless another process wrote the file since (then False: its model is newer news)."""
        with self._lock:
            if self._changed() is not None:
                return False
            if self._refused is not None and self._refused == _stamp(self.path):
                log.warning("the model refused in %s is kept as %s", self.directory, set_aside(self.directory).name)
            self._refused = None
            save_file(self.directory, data)
            self._stamp = _stamp(self.path)
            self._digest = hashlib.sha256(data).hexdigest()
            return True

    def _changed(self) -> Read | None:
        stamp = _stamp(self.path)
        if stamp == self._stamp or stamp is None:
            return None
        try:
            with open(self.path, "rb") as file:
                st = os.fstat(file.fileno())
                data = file.read()
        except FileNotFoundError:
            return None
        stamp = st.st_ino, st.st_size, st.st_mtime_ns  # of the bytes read, whatever the path names by now
        if hashlib.sha256(data).hexdigest() == self._digest:
            self._stamp = stamp  # rewritten with the same bytes
            return None
        return Read(data, stamp)


def _digest_of(path: Path) -> str | None:
    """The SHA-256 of the file's bytes; None when it cannot be read (missing, a directory, no permission: the
    load that follows names why)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def set_aside(directory: Path) -> Path:
    """Rename the artifact in `directory`, which this build refused, to `<name>.refused-<UTC time>`: the fresh model
    served meanwhile is saved under its name, and the refused one (a newer build's, say, after a rollback) would be
    lost. The new path; OSError if it cannot be renamed.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / FILE_NAME).write_bytes(b"not this build's")
    >>> set_aside(d).read_bytes(), (d / FILE_NAME).exists()
    (b"not this build's", False)
    """
    moment = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    target = directory / f"{FILE_NAME}.refused-{moment}"
    os.rename(directory / FILE_NAME, target)
    return target


def saved_class(directory: Path) -> tuple[str, str] | None:
    """(accelerator, model) the model saved in `directory` takes rows naming no class as; None without a model
    that loads (it is refused, and named, at start)."""
    try:
        config = decode(load_file(directory)).get("config", {})
        return str(config["accelerator"]), str(config["model"])
    except (ArtifactError, OSError, KeyError, TypeError):
        return None
