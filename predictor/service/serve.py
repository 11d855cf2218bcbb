"""Run the service as a process: the HTTP app under uvicorn, the gRPC server beside it, one runtime."""

from __future__ import annotations

import gc
import logging
import sys

import uvicorn

from leadtime.predictor.service.app import create_app
from leadtime.predictor.service.cpus import format_cpu_list, pin_process
from leadtime.predictor.settings import ServiceSettings

log = logging.getLogger("leadtime.service")

# Learning runs in the learner process, but this process still installs its snapshots and forwards observations
# on background threads, and gRPC handlers run on threads beside the HTTP event loop: a short GIL switch interval
# (default 5 ms) bounds how long a prediction can wait for any of them. Set per server process, never on import.
_SWITCH_INTERVAL_S = 0.0005


def serve(settings: ServiceSettings) -> None:
    """Blocks until interrupted; the HTTP app's lifespan starts and stops the background loops."""
    from leadtime.predictor.grpc.server import start_grpc_server

    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    grpc_server = None
    if settings.grpc_port:
        grpc_server, port = start_grpc_server(app.state.runtime, settings.host, settings.grpc_port)
        log.info("gRPC on %s:%d", settings.host, port)
    plan = app.state.runtime.cpu_plan
    if plan is not None:
        # After gRPC's threads exist and before uvicorn's loop starts the learner: every serving thread, and
        # everything started from here on, keeps off the learner's CPUs (the learner moves itself to them).
        pin_process(plan.serving)
        log.info("serving on CPU %s, learner on CPU %s", format_cpu_list(plan.serving), format_cpu_list(plan.learner))
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, access_log=False, log_level="warning", timeout_keep_alive=75
    )
    # Everything imported and built so far lives as long as the process: keep the collector from walking it
    # again on every full collection (each walk stalls the requests in flight).
    gc.freeze()
    try:
        uvicorn.Server(config).run()
    finally:
        if grpc_server is not None:
            grpc_server.stop(grace=1.0).wait()
