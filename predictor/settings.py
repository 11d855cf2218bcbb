"""Every option of the predictor service, each settable by a `LEADTIME_*` environment variable.

One pydantic model at the edge: `leadtime serve` builds it from its options (which fall back to the
environment), tests build it directly. Precedence: explicit value, then environment variable, then default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from leadtime.features.catalog import BUILT_IN, Catalog
from leadtime.predictor.service.hosts import check_allowed_host, parse_allowed_hosts
from leadtime.predictor.service.keys import check_key

ENV_PREFIX = "LEADTIME_"
REFUSED_WHEN_EMPTY = frozenset(
    {"api_token", "tls_certfile", "tls_keyfile", "model_from_ca_file", "redis_url", "model_dir", "allowed_hosts"}
)
"""Settings whose variable, set but empty, is refused rather than read as unset (`ServiceSettings.from_env`): the
secrets (an empty one would leave the write paths open, or serve plain HTTP), the allowed hosts (an empty list
would answer every Host where a list was meant) and where state lives (an empty Redis URL or model directory would
keep models and observations in this process only, replicas sharing nothing and a restart losing what was
learned)."""


DAY_S = 86_400.0
"""The longest period a setting may give: beyond it a period is a slip (1e12 overflowed the lease thread's wait;
threading's TIMEOUT_MAX is about 292 years)."""

MAX_BODY_BYTES = 2**31 - 1
"""The largest body limit: gRPC takes it as a C int (`grpc.max_receive_message_length`), and a larger one stopped
the service at start with an OverflowError from gRPC's core."""

MAX_WINDOW = 1_000_000
"""The most observations per target a window may keep: its arrays are allocated at the first row learned (about
0.2 GB per target per million rows) and every retrain fits on all of it, so a larger window is a slip that would
fail or swap at the first row, after the service started and said it was ready."""

MAX_INGEST_BATCH = 100_000
"""The most observations one ingest step may read: Redis takes the count as a 64-bit integer (a larger one failed
every read), and a model swap waits for the step in progress."""


class ServiceSettings(BaseModel):
    """Settings of one predictor service process."""

    # Every number finite: `LEADTIME_LEASE_TTL_S=inf` passed, and the lease thread died on Event.wait(inf / 3).
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=(), allow_inf_nan=False)

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    grpc_port: int = Field(default=50051, ge=0, le=65535, description="0 disables the gRPC server.")
    redis_url: str | None = Field(default=None, pattern=r"^(redis|rediss|unix)://.+")
    role: Literal["all", "prediction", "training"] = "all"
    objective: Literal["quantile", "mean"] = "quantile"
    quantile: float = Field(default=0.9, ge=0.5, lt=1.0, allow_inf_nan=False)
    model_dir: Path | None = None
    model_from: str | None = Field(
        default=None,
        description="With --role prediction: the training (or all) server, http(s)://HOST:PORT, whose serving model "
        "is pulled every second (GET /v1/model); the prediction server's one model source then.",
    )
    model_from_ca_file: Path | None = Field(
        default=None,
        description="PEM bundle to verify an https model_from's certificate with (default: the system's CAs).",
    )
    api_token: str | None = None
    allowed_hosts: tuple[str, ...] = Field(
        default=(),
        description="The Host headers HTTP requests may name (the DNS-rebinding defence, predictor.service.hosts); "
        "its variable is comma-separated. Empty: every Host. /healthz, /readyz and /metrics answer any Host.",
    )
    tls_certfile: Path | None = Field(
        default=None, description="PEM certificate (chain) to serve HTTPS and gRPC over TLS with; needs tls_keyfile."
    )
    tls_keyfile: Path | None = Field(default=None, description="PEM private key of tls_certfile.")
    accelerator: str = "h100-sxm"
    model: str = "llama-3.1-8b"
    catalog: Path | None = Field(
        default=None,
        description="YAML of accelerator classes and models to know beside the built-in ones (features.catalog_file).",
    )
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0, le=MAX_BODY_BYTES)
    max_rows: int = Field(default=10_000, gt=0)
    window: int = Field(
        default=20_000,
        ge=300,
        le=MAX_WINDOW,
        description="Observations per target kept for tree retraining: at least the 300 a first tree needs "
        "(LearnerConfig.min_window), or no tree is ever fitted; at most MAX_WINDOW.",
    )
    retrain_every: int = Field(default=2_000, gt=0)
    ingest_batch: int = Field(
        default=512,
        gt=0,
        le=MAX_INGEST_BATCH,
        description="Most observations the ingest loop reads and learns per step (a model swap waits for one step).",
    )
    test_every: int = Field(
        default=10, ge=2, description="Every n-th accepted sample counts as test data (/data/status)."
    )
    lease_ttl_s: float = Field(default=10.0, gt=0, le=DAY_S)
    background_nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="Nice value of the learner process (0 = same as the handlers; 19 also makes it SCHED_IDLE: it "
        "then runs only on CPU nothing else wants, and may fall behind on a saturated machine).",
    )
    min_retrain_interval_s: float = Field(
        default=2.0,
        ge=0,
        le=DAY_S,
        description="Least time between two retrains of the trees (a retrain is due every retrain_every "
        "observations; under a high observation rate this keeps retrains from running back to back and taking the "
        "CPU that learning the observations needs).",
    )
    model_save_interval_s: float = Field(
        default=60.0,
        gt=0,
        le=DAY_S,
        description="With --model-dir, how often the model is saved there while it learns (and at a clean stop).",
    )
    snapshot_interval_s: float = Field(
        default=0.25,
        gt=0,
        le=DAY_S,
        description="Most often the learner process hands its model to the serving process while it learns.",
    )
    learner_cpus: str | None = Field(
        default=None,
        pattern=r"^(auto|off|\d+(-\d+)?(,\d+(-\d+)?)*)$",
        description="CPUs of the learner process, the serving threads getting the others: off (no pinning), auto "
        "(the highest-numbered CPU this process may use, when it may use two or more) or a list such as 3, 2-3, "
        "1,3. Unset: auto when this process may use 4 or more CPUs, off below. On a 2-core machine auto lowered "
        "gRPC p99 while learning by ~2-3 ms but left the serving threads one CPU and cost ingestion rate.",
    )
    replica_id: str = ""
    seed: int = 0

    @field_validator("model_dir", "model_from_ca_file", "tls_certfile", "tls_keyfile", "catalog", mode="before")
    @classmethod
    def _home_folder(cls, value: Any) -> Any:
        """`~` as a shell expands it: a service manager's `LEADTIME_MODEL_DIR=~/models`, or `--model-dir=~/models`
        (no shell expands a tilde after `=`), made a folder named `~` where the service was started."""
        return os.path.expanduser(value) if isinstance(value, str | Path) else value

    @field_validator("api_token")
    @classmethod
    def _sendable_token(cls, value: str | None) -> str | None:
        """A token a client can send as `Authorization: Bearer TOKEN`: an empty one would leave the write paths
        open (without the warning that no token gives), one with spaces or control characters locked for all."""
        return None if value is None else check_key(value)

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _host_list(cls, value: Any) -> Any:
        """`LEADTIME_ALLOWED_HOSTS` is one string, its entries apart by commas (a Kubernetes env value)."""
        return parse_allowed_hosts(value) if isinstance(value, str) else value

    @field_validator("allowed_hosts")
    @classmethod
    def _matchable_hosts(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        """Entries as they are compared; one no Host header could match (empty, with a port or a scheme) is refused
        at start: found later, it would be every request refused, or a host meant to be allowed that is not."""
        return tuple(check_allowed_host(entry) for entry in value)

    @field_validator("model_from")
    @classmethod
    def _pullable_url(cls, value: str | None) -> str | None:
        """A URL a model can be pulled from, refused at start when it cannot be (no scheme, a port out of range):
        otherwise the server would start and fail every pull, serving the prior forever."""
        from leadtime.predictor.model_pull import check_model_url

        return None if value is None else check_model_url(value)

    @field_validator("catalog")
    @classmethod
    def _readable_catalog(cls, value: Path | None) -> Path | None:
        """A catalog that reads, refused at start (naming the entry) rather than at the first row of its class."""
        if value is not None:
            from leadtime.features.catalog_file import load_catalog

            load_catalog(value)  # CatalogError is a ValueError: pydantic names the setting
        return value

    @model_validator(mode="after")
    def _tls_files_together(self) -> ServiceSettings:
        """TLS needs both files, and both must be readable: refused at start, not at the first handshake."""
        given = [p for p in (self.tls_certfile, self.tls_keyfile) if p is not None]
        if len(given) == 1:
            raise ValueError("tls_certfile and tls_keyfile go together: give both, or neither")
        for path in given:
            if not path.is_file():
                raise ValueError(f"TLS file {str(path)!r} does not exist or is not a file")
        return self

    def read_catalog(self) -> Catalog:
        """The classes and models rows may name: the built-in ones, and the catalog file's."""
        from leadtime.features.catalog_file import load_catalog

        return BUILT_IN if self.catalog is None else load_catalog(self.catalog)

    @property
    def tls(self) -> bool:
        """Whether HTTP and gRPC are served over TLS."""
        return self.tls_certfile is not None

    @classmethod
    def from_env(
        cls, overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> ServiceSettings:
        """Settings from `LEADTIME_<FIELD>` variables, with non-None `overrides` taking precedence.

        An empty variable counts as unset, but not for a secret or a place state lives (`REFUSED_WHEN_EMPTY`):
        ValueError naming it, unless `overrides` gives that field."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        given = {name for name, value in (overrides or {}).items() if value is not None}
        for name in cls.model_fields:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None and not raw.strip() and name in REFUSED_WHEN_EMPTY and name not in given:
                raise ValueError(f"{ENV_PREFIX}{name.upper()} is set but empty: give it a value, or unset it")
            if raw is not None and raw != "":
                values[name] = raw
        for name, value in (overrides or {}).items():
            if value is not None:
                values[name] = value
        return cls.model_validate(values)

    @property
    def serves_prediction(self) -> bool:
        """Whether this process answers predictions (roles all and prediction)."""
        return self.role in ("all", "prediction")

    @property
    def serves_training(self) -> bool:
        """Whether this process accepts training data (roles all and training)."""
        return self.role in ("all", "training")
