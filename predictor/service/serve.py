"""Run the service as a process: the HTTP app under uvicorn, the gRPC server beside it, one runtime."""

from __future__ import annotations

import fcntl
import gc
import logging
import socket
import ssl
import sys
import time
from pathlib import Path
from types import FrameType
from typing import IO

import uvicorn

from leadtime.predictor.artifact import check_model_dir
from leadtime.predictor.client import https_context
from leadtime.predictor.service.app import create_app
from leadtime.predictor.service.cpus import format_cpu_list, pin_process
from leadtime.predictor.service.model_dir import saved_class
from leadtime.predictor.service.ports import check_port_free, host_port
from leadtime.predictor.service.runtime import ServiceRuntime
from leadtime.predictor.settings import ServiceSettings

log = logging.getLogger("leadtime.service")

# Learning runs in the learner process, but this process still installs its snapshots and forwards observations
# on background threads, and gRPC handlers run on threads beside the HTTP event loop: a short GIL switch interval
# (default 5 ms) bounds how long a prediction can wait for any of them. Set per server process, never on import.
_SWITCH_INTERVAL_S = 0.0005


class _Server(uvicorn.Server):
    """uvicorn's server, telling the runtime as soon as a signal asks it to stop."""

    def __init__(self, config: uvicorn.Config, runtime: ServiceRuntime) -> None:
        super().__init__(config)
        self.runtime = runtime

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.runtime.begin_shutdown()
        super().handle_exit(sig, frame)


def check_tls_files(certfile: Path, keyfile: Path) -> None:
    """Raise OSError in one line unless the files are a PEM certificate (chain) and its unencrypted private key,
    before anything is started (gRPC's C core would log three lines and blame the port; uvicorn fails only after
    the start-up log)."""
    for path in (certfile, keyfile):
        try:
            with open(path, "rb"):
                pass
        except OSError as err:
            raise OSError(f"cannot read the TLS file {str(path)!r}: {(err.strerror or str(err)).lower()}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # A password (ignored for an unencrypted key) keeps OpenSSL from prompting for one on the terminal.
        context.load_cert_chain(certfile, keyfile, password="")
    except ssl.SSLError as err:
        problem = f"are not a PEM certificate and its unencrypted private key ({err.reason or err})"
        raise OSError(f"the TLS files {str(certfile)!r} and {str(keyfile)!r} {problem}") from None
    except OSError as err:
        raise OSError(f"cannot read the TLS files {str(certfile)!r} and {str(keyfile)!r}: {err.strerror}") from None
    expires = certificate_expiry(certfile)
    if expires is not None and expires < time.time():
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(expires))
        raise OSError(f"the TLS certificate {str(certfile)!r} expired on {when}: every client would refuse it")


def certificate_expiry(certfile: Path) -> float | None:
    """When the (first) certificate of a PEM file expires, in seconds since the epoch; None when Python cannot
    tell (it reads it with a helper of its own `ssl` module, kept for its tests: absent, the check is skipped)."""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        return None
    try:
        return float(ssl.cert_time_to_seconds(decode(str(certfile))["notAfter"]))
    except (ssl.SSLError, OSError, KeyError, ValueError, TypeError):
        return None


def check_saved_class(settings: ServiceSettings) -> None:
    """Raise OSError in one line when --accelerator or --model names another class than the model saved in
    --model-dir takes rows naming none as (as `leadtime retrain` refuses the same for its registry), or when that
    class is one this process does not know (the model was trained with a catalog it was not given): every llm-d
    row would be predicted and learned as another class's."""
    assert settings.model_dir is not None
    saved = saved_class(settings.model_dir)
    if saved is None:
        return
    known = settings.read_catalog()
    if saved[0] not in known.all_accelerators or saved[1] not in known.all_models:
        raise OSError(
            f"the model in {settings.model_dir} takes rows naming no class as {saved[0]} serving {saved[1]}, which "
            "this process does not know: give it the catalog the model was trained with (--catalog)"
        )
    for name, option, given, theirs in (
        ("accelerator", "--accelerator", known.accelerator(settings.accelerator).slug, saved[0]),
        ("model", "--model", known.model(settings.model).slug, saved[1]),
    ):
        if name in settings.model_fields_set and given != theirs:
            raise OSError(
                f"{option} {given} disagrees with the model in {settings.model_dir}, which takes rows naming no "
                f"class as {theirs}"
            )


def check_model_dir_of(settings: ServiceSettings) -> None:
    """Raise OSError in one line when --model-dir cannot serve this server: one that trains must be able to save
    there (`check_model_dir`); a prediction server only reads it, so its directory, once there, may be a read-only
    mount of the training server's. Then the class of the model saved there (`check_saved_class`)."""
    if settings.model_dir is None:
        return
    if settings.serves_training or not settings.model_dir.is_dir():
        check_model_dir(settings.model_dir)
    check_saved_class(settings)


CLAIM_FILE = ".leadtime-serve.lock"
"""The file in --model-dir a server learning without Redis holds locked while it runs (`claim_model_dir`)."""


def claim_model_dir(settings: ServiceSettings) -> IO[bytes] | None:
    """The --model-dir claimed for this server, when it learns without Redis: the open file holding the claim (kept
    open while it serves; closed, or the process ended, the claim goes). Raise OSError in one line when another
    server holds it: two such servers each took up the other's saves as another process's model, by turns, each
    dropping what it had learned since. None when nothing is claimed: prediction servers only read the directory,
    and replicas sharing Redis save there only while they hold the training lease."""
    if settings.model_dir is None or not settings.serves_training or settings.redis_url is not None:
        return None
    claim = open(settings.model_dir / CLAIM_FILE, "ab")  # noqa: SIM115 (held open while the server runs)
    try:
        fcntl.flock(claim.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        claim.close()
        raise OSError(
            f"another leadtime serve learns in {settings.model_dir} without Redis: give each its own --model-dir, "
            "or share --redis between them"
        ) from None
    return claim


def check_role(settings: ServiceSettings) -> None:
    """Raise OSError in one line for a prediction server that could never see a trained model: it learns nothing
    itself, and takes its models from the training servers over HTTP (`--model-from`), or through Redis or a model
    directory they share. `--model-from` is that server's one source: with Redis or a model directory beside it,
    two sources would swap in each other's models; a server that learns makes its own."""
    if settings.model_from is not None:
        if settings.role != "prediction":
            raise OSError(
                f"--model-from is for --role prediction (a --role {settings.role} server learns its own model)"
            )
        for given, option in ((settings.redis_url, "--redis"), (settings.model_dir, "--model-dir")):
            if given is not None:
                raise OSError(f"--role prediction takes its models from --model-from or {option}, not both")
        try:
            https_context(settings.model_from, settings.model_from_ca_file)
        except ValueError as err:
            raise OSError(f"LEADTIME_MODEL_FROM_CA_FILE: {err}") from None
        return
    if settings.model_from_ca_file is not None:
        raise OSError("LEADTIME_MODEL_FROM_CA_FILE is for --model-from https://...: it is not given")
    if settings.role == "prediction" and settings.redis_url is None and settings.model_dir is None:
        raise OSError(
            "--role prediction needs --model-from http://TRAINING:PORT, or --redis or --model-dir shared with the "
            "training servers (alone it would answer from the untrained prior forever); --role all serves both of "
            "llm-d's URLs from one process"
        )


def describe_store(store: object, model_dir: Path | None = None) -> str:
    """How the log names the store: Redis with its address (credentials left out), or this process's memory (and
    where its models outlive it, with a model directory).

    >>> describe_store(object(), Path("models"))
    'in memory (this process only: observations go when it stops; models are kept in models)'
    """
    address = getattr(store, "address", None)
    if address is not None:
        return f"Redis at {address}"
    if model_dir is not None:
        return f"in memory (this process only: observations go when it stops; models are kept in {model_dir})"
    return "in memory (this process only: observations and models go when it stops)"


def serve(settings: ServiceSettings) -> None:
    """Blocks until interrupted; the HTTP app's lifespan starts and stops the background loops.

    A port another process holds (or the same port given to HTTP and gRPC), TLS files that are not a
    certificate and key, a model directory it cannot save in, or a prediction role with no way to receive models
    stop it with one OSError before anything starts
    (the CLI prints it and exits 2); so does a Redis URL that cannot be used (`StoreError`). Ctrl-C or SIGTERM
    shuts it down quietly: the learner process ignores both, the service stops it.
    """
    from leadtime.predictor.grpc.server import STOP_GRACE_S, serve_grpc
    from leadtime.predictor.metrics import expose_without_created_series

    check_role(settings)
    expose_without_created_series()
    if settings.grpc_port and settings.grpc_port == settings.port:
        raise OSError(f"cannot serve gRPC on {host_port(settings.host, settings.grpc_port)}: it is the HTTP port too")
    check_port_free(settings.host, settings.port, "HTTP")
    if settings.grpc_port:
        check_port_free(settings.host, settings.grpc_port, "gRPC")
    if settings.tls_certfile is not None and settings.tls_keyfile is not None:
        check_tls_files(settings.tls_certfile, settings.tls_keyfile)
    check_model_dir_of(settings)
    claim = claim_model_dir(settings)
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: with --model-from, a line a second for as long as the server runs.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = create_app(settings)
    runtime = app.state.runtime
    grpc_server = None
    scheme, tls = ("https", " over TLS") if settings.tls else ("http", "")
    if settings.grpc_port:
        # Stopped (with its grace) by the runtime before it stops its loops and closes the store, not after
        # uvicorn returns: the app's lifespan stops the runtime first.
        grpc_server, port = serve_grpc(runtime, settings.host, settings.grpc_port)
        log.info("gRPC%s on %s", tls, host_port(settings.host, port))
    else:
        log.info("gRPC off (grpc_port 0)")
    http_port, sockets = settings.port, None
    if http_port == 0:  # the system picks the port: bound here, so that the log can say which
        family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((settings.host, 0))
        http_port, sockets = sock.getsockname()[1], [sock]
    log.info("HTTP on %s://%s (API docs at /docs)", scheme, host_port(settings.host, http_port))
    if settings.allowed_hosts:
        log.info(
            "HTTP answers only the Host %s (--allowed-host; /healthz, /readyz and /metrics any)",
            ", ".join(settings.allowed_hosts),
        )
    if settings.api_token is None and settings.serves_training:  # a prediction server takes no training data
        log.warning(
            "no API token: anyone who can reach this port can send training data (--api-token or LEADTIME_API_TOKEN "
            "sets one; see SECURITY.md in the source)"
        )
    log.info("store: %s", describe_store(runtime.store, settings.model_dir))
    if settings.model_from is not None:
        log.info(
            "models from %s (GET /v1/model every second); the physics prior serves until the first arrives",
            settings.model_from,
        )
    if settings.role == "training" and settings.redis_url is None and settings.model_dir is None:
        log.warning(
            "--role training without --redis or --model-dir: its model is lost when it stops, and the prediction "
            "servers pulling it (--model-from) go back to the prior"
        )
    plan = runtime.cpu_plan
    if plan is not None:
        # After gRPC's threads exist and before uvicorn's loop starts the learner: every serving thread, and
        # everything started from here on, keeps off the learner's CPUs (the learner moves itself to them).
        pin_process(plan.serving)
        log.info("serving on CPU %s, learner on CPU %s", format_cpu_list(plan.serving), format_cpu_list(plan.learner))
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        access_log=False,
        log_level="warning",
        timeout_keep_alive=75,
        ssl_certfile=settings.tls_certfile,
        ssl_keyfile=settings.tls_keyfile,
    )
    # Everything imported and built so far lives as long as the process: keep the collector from walking it
    # again on every full collection (each walk stalls the requests in flight).
    gc.freeze()
    try:
        _Server(config, runtime).run(sockets=sockets)
    finally:
        if grpc_server is not None:
            grpc_server.stop(grace=STOP_GRACE_S).wait()
        if claim is not None:
            claim.close()
        log.info("stopped")
