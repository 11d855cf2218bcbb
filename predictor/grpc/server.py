"""The gRPC face of the service: PredictBulk, Observe (one batch, or a client stream of batches) and Status, with
grpc.health.v1 beside them (`health.py`).

It shares the HTTP app's runtime (same predictor, store, metrics, role), so both faces answer alike. Bad rows get
INVALID_ARGUMENT naming `rows[i].field`, and so does a message that is not protobuf at all (it is parsed here,
not by gRPC, which would answer INTERNAL and log a traceback per message); a missing API token on Observe gets
UNAUTHENTICATED; a call of the role this process does not serve UNIMPLEMENTED (404 over HTTP); messages larger
than the body limit are refused by gRPC itself (RESOURCE_EXHAUSTED). An open ObserveStream holds a worker thread
until its client ends it, so at most `MAX_OPEN_STREAMS` are open at once, and at most `MAX_OPEN_OBSERVES` Observe
calls run at once: the other threads answer the rest.
"""

from __future__ import annotations

import operator
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from leadtime.features.errors import FeatureError
from leadtime.features.rows import LLMD_FIELDS
from leadtime.features.vectorize import FeatureBatch
from leadtime.predictor.grpc import leadtime_pb2 as pb
from leadtime.predictor.grpc import leadtime_pb2_grpc as pb_grpc
from leadtime.predictor.grpc.health import add_health_service
from leadtime.predictor.grpc.streams import STOPPING_MESSAGE, OpenStreams, ServiceStopping
from leadtime.predictor.service.ports import host_port
from leadtime.predictor.service.runtime import (
    BACKLOG_FULL_MESSAGE,
    MAX_OBSERVATIONS_PER_CALL,
    ServiceRuntime,
    rfc3339,
    served_ms,
)
from leadtime.predictor.store.base import StoreClosed

T = TypeVar("T")

MAX_OPEN_STREAMS = 4
"""ObserveStream calls open at once; one more is refused (RESOURCE_EXHAUSTED) rather than queued behind them."""
MAX_OPEN_OBSERVES = 2
"""Observe calls running at once; one more is refused (RESOURCE_EXHAUSTED, retry) rather than queued: a 50,000-row
call holds its thread for about a second, and with the streams open they took the threads kept for predictions."""
WORKER_THREADS = MAX_OPEN_STREAMS + MAX_OPEN_OBSERVES + 4
"""Threads for every open stream and Observe call, and 4 more that only reads (PredictBulk, Status, health) and
refusals can take."""
STOPPING_NOTICE_S = 0.5
"""At a stop, how long health answers NOT_SERVING (and writes UNAVAILABLE) before the server stops taking calls:
a stopping gRPC server refuses every new call, so a probe would otherwise see only the port go away."""
STOP_GRACE_S = 1.0
"""Then, how long the calls in flight are given to finish before gRPC cancels them."""

# The fields of the messages, read off the proto descriptor (the proto is where they are defined).
ROW_FIELDS = tuple(field.name for field in pb.Row.DESCRIPTOR.fields)
COLUMN_FIELDS = tuple(field.name for field in pb.RowColumns.DESCRIPTOR.fields)  # the Row fields' names
# llm-d's fields are always copied; Leadtime's only when set (unset, they mean "the default").
_LLMD_ROW_FIELDS = tuple(name for name in ROW_FIELDS if name in LLMD_FIELDS)
_GET_LLMD = operator.attrgetter(*_LLMD_ROW_FIELDS)
_EXTRA_FIELDS = tuple(name for name in ROW_FIELDS if name not in LLMD_FIELDS)
_PRESENCE = frozenset(f.name for f in pb.Row.DESCRIPTOR.fields if f.has_presence)
_OBSERVATION_FIELDS = tuple(f.name for f in pb.Observation.DESCRIPTOR.fields if f.name != "row")
_OBSERVATION_OPTIONAL = frozenset(f.name for f in pb.Observation.DESCRIPTOR.fields if f.has_presence)


def row_to_dict(row: Any) -> dict[str, Any]:
    """A Row message → the JSON-row shape the service validates (extras only when set)."""
    d = dict(zip(_LLMD_ROW_FIELDS, _GET_LLMD(row), strict=True))
    for name in _EXTRA_FIELDS:
        if row.HasField(name) if name in _PRESENCE else getattr(row, name):
            d[name] = getattr(row, name)
    return d


def observation_to_dict(obs: Any) -> dict[str, Any]:
    """An Observation message → the JSON-entry shape the service validates."""
    d = row_to_dict(obs.row)
    for name in _OBSERVATION_FIELDS:
        if name not in _OBSERVATION_OPTIONAL or obs.HasField(name):
            d[name] = getattr(obs, name)
    return d


class BacklogFull(Exception):
    """The learner's backlog is full, or every stream is taken: nothing is accepted until then (RESOURCE_EXHAUSTED,
    retry later)."""


class NotThisRole(Exception):
    """A call of the role this process does not serve (UNIMPLEMENTED)."""


class CallerGone(Exception):
    """The caller gave up (its deadline passed) before its observations were accepted: none are kept, for it was
    told they failed and may send them again (CANCELLED)."""


class Malformed:
    """What a message that does not parse is handed to the method as: it answers INVALID_ARGUMENT."""

    def __init__(self, message_name: str, problem: str) -> None:
        self.message_name = message_name
        self.problem = problem

    def error(self, field: str) -> FeatureError:
        """What to answer, naming `field` as where the bad message was."""
        return FeatureError(field, f"is not a valid {self.message_name} message ({self.problem})")


def lenient_parser(message_class: Any) -> Callable[[bytes], Any]:
    """`message_class.FromString` that hands back `Malformed` instead of raising."""
    name = message_class.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as err:
            return Malformed(name, str(err) or "cannot be decoded")

    return parse


STATUS_OF: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (FeatureError, grpc.StatusCode.INVALID_ARGUMENT),
    (PermissionError, grpc.StatusCode.UNAUTHENTICATED),
    (BacklogFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotThisRole, grpc.StatusCode.UNIMPLEMENTED),
    (CallerGone, grpc.StatusCode.CANCELLED),
    (StoreClosed, grpc.StatusCode.UNAVAILABLE),
    (ServiceStopping, grpc.StatusCode.UNAVAILABLE),
)
"""The status each refusal is answered with."""
REFUSALS = tuple(kind for kind, _ in STATUS_OF)


def _ended_by_grpc(context: grpc.ServicerContext) -> grpc.StatusCode | None:
    """How gRPC ended a call under its method, if it did: its deadline passed, or its client cancelled it (or sent
    a stream message over the size limit). The method sees these as an error from its request iterator, or as the
    stream's normal end, and its answer reaches nobody.

    Why: such calls were counted `OK` in `leadtime_grpc_requests_total`, so a dashboard of failed calls showed none
    of them."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if not context.is_active():
        return grpc.StatusCode.CANCELLED
    return None


class PredictorServicer(pb_grpc.PredictorServicer):
    """Implements leadtime.v1.Predictor over a ServiceRuntime."""

    def __init__(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime
        self.streams = OpenStreams(MAX_OPEN_STREAMS)
        self._observes = threading.BoundedSemaphore(MAX_OPEN_OBSERVES)

    def _call(self, method: str, context: grpc.ServicerContext, body: Callable[[], T], write: bool = False) -> T:
        """Timing, metrics and the mapping of errors to status codes, shared by every method. While the service
        stops, reads are still answered (the model is there until the server has stopped) and writes refused,
        none kept, so that their client sends them to another replica."""
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            if self.runtime.predictor is None:
                code = grpc.StatusCode.UNAVAILABLE
                context.abort(code, "the predictor is not ready: the service has not finished starting")
            if write and not self.runtime.ready:
                code = grpc.StatusCode.UNAVAILABLE
                context.abort(code, STOPPING_MESSAGE)
            answer = body()
            code = _ended_by_grpc(context) or code
            return answer
        except REFUSALS as err:
            code = next(code for kind, code in STATUS_OF if isinstance(err, kind))
            if isinstance(err, CallerGone):  # counted as its client was told: a deadline that passed is no cancel
                code = _ended_by_grpc(context) or code
            context.abort(code, str(err))
        except Exception:
            if code is grpc.StatusCode.OK:  # not an abort above: the call failed without a status of ours
                code = _ended_by_grpc(context) or grpc.StatusCode.UNKNOWN  # UNKNOWN: what gRPC answers a bug with
            raise
        finally:
            metrics = self.runtime.metrics
            metrics.grpc_requests.labels(method, code.name).inc()
            metrics.grpc_seconds.labels(method).observe(time.perf_counter() - started)
        raise AssertionError("unreachable: context.abort raises")

    def _check_token(self, context: grpc.ServicerContext) -> None:
        token = self.runtime.settings.api_token
        if not token:
            return
        given = dict(context.invocation_metadata()).get("authorization", "")
        scheme, _, value = str(given).partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(value.strip().encode(), token.encode()):
            raise PermissionError("writes need metadata 'authorization: Bearer <api token>'")

    def _check_role(self, method: str, serves: bool) -> None:
        if not serves:
            role = self.runtime.settings.role
            other = "prediction" if role == "training" else "training"
            raise NotThisRole(f"this process serves --role {role}: {method} is served by --role all or {other}")

    def PredictBulk(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 (gRPC's name)
        """Mean and upper quantile of both targets for every row (messages or columns)."""

        def body() -> Any:
            runtime = self.runtime
            self._check_role("PredictBulk", runtime.settings.serves_prediction)
            if isinstance(request, Malformed):
                raise request.error("request")
            parsed = self._parse_bulk(request)
            predictor = runtime.predictor
            assert predictor is not None
            p = predictor.predict_many(parsed)
            runtime.metrics.predictions.labels("grpc").inc(len(parsed))
            return pb.PredictBulkResponse(
                ttft_mean_ms=served_ms(p.ttft_mean),
                ttft_quantile_ms=served_ms(p.ttft_quantile),
                tpot_mean_ms=served_ms(p.tpot_mean),
                tpot_quantile_ms=served_ms(p.tpot_quantile),
                model_version=p.model_version,
                quantile=runtime.settings.quantile,
                objective_type=runtime.settings.objective,
            )

        return self._call("PredictBulk", context, body)

    def _parse_bulk(self, request: Any) -> FeatureBatch:
        """The request's rows, given as messages or as columns, checked and vectorized."""
        limit = self.runtime.settings.max_rows
        parser = self.runtime.parser
        if request.HasField("columns"):
            if request.rows:
                raise FeatureError("columns", "give rows or columns, not both")
            columns = {name: getattr(request.columns, name) for name in COLUMN_FIELDS}
            n = max(map(len, columns.values()))
            if not 1 <= n <= limit:
                raise FeatureError("columns", f"must hold 1 to {limit:,} rows, got {n:,}")
            return parser.parse_column_lists(columns, "columns")
        rows = request.rows
        if not 1 <= len(rows) <= limit:
            raise FeatureError("rows", f"must hold 1 to {limit:,} rows, got {len(rows):,}")
        return parser.parse_messages(rows, row_to_dict)

    def _accept(self, observations: Sequence[Any], context: grpc.ServicerContext) -> int:
        runtime = self.runtime
        if len(observations) > MAX_OBSERVATIONS_PER_CALL:  # as over HTTP
            raise FeatureError(
                "observations", f"must hold at most {MAX_OBSERVATIONS_PER_CALL:,} items, got {len(observations):,}"
            )
        if runtime.backlog_full():
            raise BacklogFull(BACKLOG_FULL_MESSAGE)
        try:
            for i, o in enumerate(observations):
                if not o.HasField("row"):  # unset, it would read as a row of zeros: no tokens, no load
                    raise FeatureError(f"observations[{i}].row", "is required")
            entries = [observation_to_dict(o) for o in observations]
            parsed = runtime.parser.parse_observations(entries, "observations")
        except FeatureError:
            runtime.metrics.observations_rejected.labels("grpc").inc(len(observations))
            raise
        if not context.is_active():
            raise CallerGone("the caller gave up before its observations were accepted: none of them were kept")
        runtime.accept(entries, parsed.actual_ttft_ms, parsed.actual_tpot_ms)
        runtime.metrics.observations_accepted.labels("grpc").inc(len(entries))
        runtime.record_live_errors(parsed)
        return len(entries)

    def Observe(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        """Accept one batch of observations, all or nothing."""

        def body() -> Any:
            self._check_role("Observe", self.runtime.settings.serves_training)
            self._check_token(context)
            if isinstance(request, Malformed):
                raise request.error("request")
            if not self._observes.acquire(blocking=False):
                raise BacklogFull(f"observations busy ({MAX_OPEN_OBSERVES} Observe calls are running): retry later")
            try:
                return pb.ObserveResponse(accepted=self._accept(request.observations, context))
            finally:
                self._observes.release()

        return self._call("Observe", context, body, write=True)

    def ObserveStream(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:  # noqa: N802
        """Accept a client stream of batches, each on arrival."""

        def body() -> Any:
            self._check_role("ObserveStream", self.runtime.settings.serves_training)
            self._check_token(context)
            batches = self.streams.open(request_iterator)
            if batches is None:
                raise BacklogFull(
                    f"{MAX_OPEN_STREAMS} observation streams are open already: retry later, or use Observe"
                )
            try:
                return pb.ObserveResponse(accepted=self._accept_stream(batches, context))
            finally:
                self.streams.close(batches)

        return self._call("ObserveStream", context, body, write=True)

    def _accept_stream(self, batches: Iterator[Any], context: grpc.ServicerContext) -> int:
        total, k = 0, 0
        while True:
            # The batches before a refused one are kept: say so, or a client would send them again.
            kept = f"{total:,} observations of the batches before it were accepted"
            try:
                batch = next(batches)
            except StopIteration:
                return total
            except ServiceStopping as stopping:  # told at a stop, before gRPC would cancel the call with no count
                raise ServiceStopping(f"batches[{k}]: {stopping} ({kept})") from None
            if isinstance(batch, Malformed):
                err = batch.error("request")
                raise FeatureError(f"batches[{k}]", f"{err.problem} ({kept})")
            try:
                total += self._accept(batch.observations, context)
            except FeatureError as err:
                raise FeatureError(err.under(f"batches[{k}]").field, f"{err.problem} ({kept})") from None
            except (BacklogFull, CallerGone, StoreClosed) as err:
                raise type(err)(f"batches[{k}]: {err} ({kept})") from None
            k += 1

    def Status(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        """Readiness, model version, lease, component health and what was learned."""

        def body() -> Any:
            runtime = self.runtime
            predictor = runtime.predictor
            assert predictor is not None
            return pb.StatusResponse(
                is_ready=runtime.ready,
                model_version=predictor.version,
                objective_type=runtime.settings.objective,
                quantile=runtime.settings.quantile,
                last_model_load=rfc3339(predictor.last_model_load) or "",
                role=runtime.settings.role,
                holds_training_lease=runtime.holds_lease,
                components=runtime.health(),
                observations=runtime.learned(),
            )

        return self._call("Status", context, body)


def method_handlers(servicer: PredictorServicer) -> grpc.GenericRpcHandler:
    """The service's methods, read off the proto, each parsing its requests with `lenient_parser`."""
    service = pb.DESCRIPTOR.services_by_name["Predictor"]
    handlers = {}
    for method in service.methods:
        assert not method.server_streaming, method.name  # none streams its answer
        make = grpc.stream_unary_rpc_method_handler if method.client_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=lenient_parser(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def start_grpc_server(
    runtime: ServiceRuntime, host: str, port: int, max_workers: int = WORKER_THREADS
) -> tuple[grpc.Server, int]:
    """Start serving on host:port (0 = any free port), over TLS when the settings name a certificate and key;
    returns the server and the bound port."""
    server, bound, _ = _start(runtime, host, port, max_workers)
    return server, bound


def _start(
    runtime: ServiceRuntime, host: str, port: int, max_workers: int
) -> tuple[grpc.Server, int, PredictorServicer]:
    limit = runtime.settings.max_body_bytes
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="leadtime-grpc"),
        options=[("grpc.max_receive_message_length", limit), ("grpc.so_reuseport", 0)],
    )
    servicer = PredictorServicer(runtime)
    server.add_generic_rpc_handlers((method_handlers(servicer),))
    add_health_service(server, runtime)
    settings = runtime.settings
    try:
        if settings.tls_certfile is not None and settings.tls_keyfile is not None:
            key_and_cert = (settings.tls_keyfile.read_bytes(), settings.tls_certfile.read_bytes())
            bound = server.add_secure_port(host_port(host, port), grpc.ssl_server_credentials([key_and_cert]))
        else:
            bound = server.add_insecure_port(host_port(host, port))
    except RuntimeError:  # grpc's own words point at GRPC_VERBOSITY rather than at the port
        bound = 0
    if bound == 0:
        where = host_port(host, port)
        raise OSError(f"cannot serve gRPC on {where}: the port is taken or the address is not this machine's")
    server.start()
    return server, bound, servicer


def serve_grpc(runtime: ServiceRuntime, host: str, port: int) -> tuple[grpc.Server, int]:
    """`start_grpc_server`, stopped by `runtime.stop()` (as `leadtime serve` runs it): the runtime turns not
    ready first, open streams end (each naming its count) and health answers NOT_SERVING for `STOPPING_NOTICE_S`,
    then the server stops with its grace, before the store closes."""
    server, bound, servicer = _start(runtime, host, port, WORKER_THREADS)

    def stop() -> None:
        # Open streams are told first: each ends with its own UNAVAILABLE naming its count, rather than being
        # cancelled by gRPC after its grace with none (a client would then send the whole stream again).
        notice_ends = time.monotonic() + STOPPING_NOTICE_S
        servicer.streams.stop_all(STOPPING_NOTICE_S)
        time.sleep(max(0.0, notice_ends - time.monotonic()))
        server.stop(grace=STOP_GRACE_S).wait()

    runtime.add_server(stop)
    return server, bound
