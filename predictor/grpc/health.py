"""grpc.health.v1 for the gRPC face: what Kubernetes' gRPC probes and `grpc_health_probe` ask.

A service is SERVING while the process is ready (the HTTP /readyz rule: a Redis outage degrades learning, not
serving; a training-role process is ready too, though it answers no prediction), NOT_SERVING once it stops (the
port opens only when start-up has finished). Its status is read at each call rather than pushed at each change, so
it cannot fall out of step with the runtime. `Watch` is refused (UNIMPLEMENTED): an open stream would hold one of
the server's few worker threads for as long as the prober keeps it.
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from leadtime.predictor.grpc import leadtime_pb2 as pb
from leadtime.predictor.service.runtime import ServiceRuntime

SERVICES = ("", pb.DESCRIPTOR.services_by_name["Predictor"].full_name)
"""What the health service answers for: the whole server ("") and leadtime.v1.Predictor."""


class HealthCheck(health_pb2_grpc.HealthServicer):
    """Check and List, answered from the runtime's readiness."""

    def __init__(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime

    def _status(self) -> Any:
        response = health_pb2.HealthCheckResponse
        return response.SERVING if self.runtime.ready else response.NOT_SERVING

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 (gRPC's name)
        """The status of one service; NOT_FOUND for a name this server does not have, as the protocol asks."""
        if request.service not in SERVICES:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.service!r} here; ask for one of {SERVICES}")
        return health_pb2.HealthCheckResponse(status=self._status())

    def Watch(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        """Refused as UNIMPLEMENTED (client-side health checking then takes the server as healthy), said here: the
        base class raised NotImplementedError, which gRPC logged with a traceback at every call."""
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not served here; call Check (or List)")

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        """Every service this server answers for, with its status."""
        status = self._status()
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name in SERVICES}
        )


def add_health_service(server: grpc.Server, runtime: ServiceRuntime) -> None:
    """Serve grpc.health.v1 on `server` for `runtime`."""
    health_pb2_grpc.add_HealthServicer_to_server(HealthCheck(runtime), server)
