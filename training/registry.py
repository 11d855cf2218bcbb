"""The model registry the job reads its champion from and publishes to: a directory or Redis, as the service has.

- A directory is what `leadtime serve --model-dir DIR` loads at start and saves to: one artifact file written
  atomically (`predictor/artifact.py`); its version is the one the artifact records.
- A Redis URL is the service's shared registry (`RedisStore`: versioned keys, the last five kept, a pub/sub
  notification on which every replica swaps the new model in within a second); ``?namespace=NAME`` names a
  registry other than the service's default one.

Both hold the same bytes: the JSON + LightGBM-text artifact that `OnlinePredictor.from_bytes` loads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from leadtime.predictor.artifact import FILE_NAME, ArtifactError, check_model_dir, decode, load_file, save_file
from leadtime.predictor.store.stream_identity import StreamIdentity
from leadtime.training.sources import RedisSource, is_redis_url


class RegistryError(RuntimeError):
    """The registry cannot be read or written (one line)."""


@dataclass(frozen=True)
class Published:
    """A model the registry holds: its version and its artifact."""

    version: int
    artifact: bytes

    @property
    def digest(self) -> str:
        """SHA-256 of the artifact: whether the registry moved on, where versions do not say it."""
        return hashlib.sha256(self.artifact).hexdigest()


class Registry(Protocol):
    """What the job needs of a registry."""

    name: str
    stream: StreamIdentity | None  # the observation stream beside it (a Redis registry's), or None

    def latest(self) -> Published | None:
        """The newest model, or None when the registry holds none."""
        ...

    def publish(self, artifact: bytes) -> int:
        """Store `artifact` as the newest model; returns its version."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


class DirectoryRegistry:
    """The artifact file in a directory, as `leadtime serve --model-dir` keeps it."""

    def __init__(self, directory: Path) -> None:
        if directory.exists() and not directory.is_dir():
            raise RegistryError(f"{directory}: not a directory (the registry is a directory or a redis:// URL)")
        try:
            check_model_dir(directory)  # before the job reads and fits, not when it has a model to publish
        except OSError as err:
            raise RegistryError(str(err)) from None
        self.directory = directory
        self.name = str(directory)
        self.stream: StreamIdentity | None = None  # no observation stream beside a directory

    def latest(self) -> Published | None:
        """The artifact in the directory (its recorded version), or None when there is none."""
        if not (self.directory / FILE_NAME).exists():
            return None
        try:
            data = load_file(self.directory)
            version = int(decode(data).get("version", 0))
        except (ArtifactError, OSError, ValueError) as err:
            raise RegistryError(f"{self.directory / FILE_NAME}: {err}") from None
        return Published(version, data)

    def publish(self, artifact: bytes) -> int:
        """Write the artifact atomically; its version is the one it records."""
        try:
            save_file(self.directory, artifact)
            return int(decode(artifact).get("version", 0))
        except OSError as err:
            raise RegistryError(f"{self.directory}: cannot write the model ({err.strerror or err})") from None

    def close(self) -> None:
        """Nothing to release."""


class RedisRegistry:
    """The service's shared registry in Redis (through its own `RedisStore`)."""

    def __init__(self, url: str) -> None:
        from leadtime.predictor.store.redis_store import RedisStore

        source = RedisSource.parse(url)
        self.name = source.name
        try:
            self.store = RedisStore(source.url, namespace=source.namespace)
        except ValueError as err:
            raise RegistryError(str(err)) from None
        self.stream: StreamIdentity | None = self.store.stream  # as the service's own store names it
        problem = self._problem()
        if problem is not None:
            self.store.close(flush_timeout_s=0.0)
            raise RegistryError(f"{self.name}: {problem}")

    def _problem(self) -> str | None:
        """Why Redis cannot be used now (the store's health without its observation-buffer counts), or None."""
        health = self.store.health().get("redis", "ok")
        return None if health == "ok" else health.split("; ")[0]

    def latest(self) -> Published | None:
        """The newest published version, or None when none is (an outage is a RegistryError, not an empty one)."""
        from leadtime.predictor.store.redis_store import StoreUnavailable

        try:
            found = self.store.read_latest_model()
        except StoreUnavailable as err:
            raise RegistryError(f"{self.name}: {err}") from None
        return None if found is None else Published(*found)

    def publish(self, artifact: bytes) -> int:
        """Publish as the service's lease holder does: the next version, and a notification to every replica."""
        from leadtime.predictor.store.redis_store import StoreUnavailable

        try:
            return self.store.publish_model(artifact)
        except (StoreUnavailable, ValueError) as err:
            raise RegistryError(f"{self.name}: {err}") from None

    def close(self) -> None:
        """Close the store's connections and threads."""
        self.store.close(flush_timeout_s=0.0)


def open_registry(spec: str) -> Registry:
    """A directory path or a ``redis://`` URL."""
    if is_redis_url(spec):
        return RedisRegistry(spec)
    return DirectoryRegistry(Path(spec))
