"""The predictor's on-disk and on-wire form: one JSON document with LightGBM models embedded as text.

Never pickle: an artifact pulled from Redis or a shared volume is data, and loading it cannot run code. The
document names its format, the feature schema version and the column order, and ends with a SHA-256 checksum of
everything before it; anything else, and any document whose checksum does not match (a flipped byte on disk, an
edit by hand or by someone with write access to the registry who did not recompute it), is refused. The checksum
detects tampering and corruption; it is not a signature: whoever can write the registry can also write a
matching checksum, so the registry itself must be protected (see SECURITY.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from leadtime.features.vectorize import COLUMNS, SCHEMA_VERSION

FORMAT = "leadtime-predictor"
# 2: per-class offsets are keyed by class name ("h100-sxm/llama-3.1-8b/tp1"), no longer by rounded figures.
# 3: a SHA-256 checksum of the whole document.
ARTIFACT_VERSION = 3
FILE_NAME = "leadtime-predictor.json"


class ArtifactError(ValueError):
    """A saved predictor is corrupt, not a Leadtime artifact, or of another schema version."""


def encode(state: dict[str, Any]) -> bytes:
    """A learner's state (`OnlinePredictor.snapshot()[0]`) as the artifact's bytes: JSON with its format,
    version and column order."""
    document = {
        "format": FORMAT,
        "artifact_version": ARTIFACT_VERSION,
        "schema_version": SCHEMA_VERSION,
        "columns": list(COLUMNS),
        **{k: v for k, v in state.items() if k != CHECKSUM_KEY},
    }
    return seal(document)


CHECKSUM_KEY = "checksum"


def _digest(document: dict[str, Any]) -> str:
    """SHA-256 of the document's JSON (without its checksum), as `encode` writes it. Parsing and writing again
    gives the same bytes (key order is kept, floats round-trip exactly), so a reader can recompute it."""
    body = {k: v for k, v in document.items() if k != CHECKSUM_KEY}
    return "sha256:" + hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()


def seal(document: dict[str, Any]) -> bytes:
    """The document's bytes with its checksum added last."""
    body = {k: v for k, v in document.items() if k != CHECKSUM_KEY}
    body[CHECKSUM_KEY] = _digest(body)
    return json.dumps(body, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[str, Any]:
    """An artifact's bytes → the state `OnlinePredictor.from_state` takes; ArtifactError for anything that is not
    an artifact of this build's format, version and columns."""
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ArtifactError(f"not a Leadtime artifact: not JSON ({err.__class__.__name__})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ArtifactError("not a Leadtime artifact: missing or wrong 'format'")
    if document.get("artifact_version") != ARTIFACT_VERSION:
        found = document.get("artifact_version")
        raise ArtifactError(f"artifact version {found!r} is not supported (this build reads {ARTIFACT_VERSION})")
    if document.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(
            f"feature schema version {document.get('schema_version')!r} differs from this build's {SCHEMA_VERSION}"
        )
    if document.get("columns") != list(COLUMNS):
        raise ArtifactError("feature columns differ from this build's column order")
    if document.get(CHECKSUM_KEY) != _digest(document):
        raise ArtifactError("the artifact does not match its checksum: corrupted or altered since it was written")
    del document[CHECKSUM_KEY]
    for key in ("config", "targets"):
        if not isinstance(document.get(key), dict):
            raise ArtifactError(f"artifact lacks {key!r}")
    return document


def save_file(directory: str | os.PathLike[str], data: bytes) -> Path:
    """Write atomically (temp file + rename) so a reader never sees half an artifact: as `FILE_NAME` in a
    directory (made if need be), or, given a path ending in `.json` that is not a directory, as that file (what
    `load_file` takes too)."""
    path = Path(directory)
    if path.suffix != ".json" or path.is_dir():
        path = path / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".artifact-")
    try:
        with os.fdopen(fd, "wb") as f:
            # mkstemp makes the file 0600: the mode the umask gives, as for any file written, so that a prediction
            # server or a retraining job running as another user can read a shared model directory.
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename: a power cut leaves the old artifact or the new one
        os.replace(tmp, path)
    except BaseException:
        # A failed write (a full disk) leaves no partial temporary file behind to keep the disk full.
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    """The process's umask, read without setting it (os.umask sets it, for every thread at once); 022 where
    /proc does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def check_model_dir(path: Path) -> None:
    """Raise OSError in one line when the model cannot be saved in `path` (`check_writable_dir`). Otherwise the
    service would run and fail to save at every retrain."""
    check_writable_dir(path, "the model directory")


def check_writable_dir(path: Path, what: str) -> None:
    """Raise OSError in one line, naming `path` as `what`, when files cannot be written in it: it is not a
    directory, or it cannot be made or written (it is made here, and a file written in it and removed: permissions
    alone do not tell, as root or on a read-only or virtual file system)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "" if existing == path else f" ({str(existing)!r} is a file)"
        raise OSError(f"{what} {str(path)!r} is not a directory{where}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise OSError(f"{what} {str(path)!r} cannot be written ({err.strerror or err})") from None


def missing_dirs(*paths: Path) -> list[Path]:
    """The directories among `paths` that do not exist yet, with their missing parents, deepest first: what
    `check_writable_dir` (or a `mkdir(parents=True)`) is about to make, for `remove_empty_dirs` to take back when the
    command then fails before anything is written there."""
    missing: list[Path] = []
    for path in paths:
        while not path.exists() and path != path.parent and path not in missing:
            missing.append(path)
            path = path.parent
    return sorted(missing, key=lambda p: len(p.absolute().parts), reverse=True)


def remove_empty_dirs(directories: list[Path]) -> None:
    """Remove each of `directories` (deepest first, as `missing_dirs` lists them) that is still empty: one a file
    went into stays."""
    for directory in directories:
        with contextlib.suppress(OSError):
            directory.rmdir()


def load_file(directory: str | os.PathLike[str]) -> bytes:
    """The artifact's bytes from a directory (or the file itself); ArtifactError when there is none."""
    path = Path(directory)
    if path.is_dir():
        path = path / FILE_NAME
    if not path.exists():
        raise ArtifactError(f"no artifact at {path}")
    return path.read_bytes()
