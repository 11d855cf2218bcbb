"""The serving stack with nothing behind it: what `leadtime bench serving` compares the service against.

The same FastAPI + uvicorn (httptools, uvloop) and grpcio servers the service runs, answering the same paths with
answers of the same size and shape, but without validating rows or predicting anything. Measured side by side
with the service in one run, it shows how much of a latency percentile is the stack and the machine (on a shared
2-core machine, most of p99) and how much is Leadtime's own work.

With `--work-us N` every answer first keeps the CPU busy for N µs, the service's own median time per call: on a
virtual machine whose idle CPUs sleep, a client that waits longer than a few hundred µs wakes up late, and this
shows what that costs any server that works as long as the service does, with no variance and no interference.

    python -m leadtime.bench.stack_floor --port P --grpc-port G [--work-us N]
"""

from __future__ import annotations

import argparse
import time
from concurrent import futures
from datetime import UTC, datetime
from typing import Any

import grpc
import orjson
import uvicorn
from fastapi import FastAPI, Request, Response

from leadtime.predictor.grpc import leadtime_pb2 as pb
from leadtime.predictor.grpc import leadtime_pb2_grpc as pb_grpc


def busy(work_s: float) -> None:
    """Keep this CPU busy (not asleep) for `work_s` seconds: the stand-in for a service's work."""
    until = time.perf_counter() + work_s
    while time.perf_counter() < until:
        pass


def create_floor_app(work_s: float = 0.0) -> FastAPI:
    """An HTTP app answering /predict/bulk/strict with constants after `work_s` of busy work: the stack's own cost."""
    app = FastAPI()

    @app.post("/predict/bulk/strict")
    async def predict_bulk_strict(request: Request) -> Response:
        rows = orjson.loads(await request.body())["requests"]
        busy(work_s)
        at = datetime.now(UTC).isoformat()
        answer = {
            "ttft_ms": 100.0,
            "tpot_ms": 10.0,
            "predicted_at": at,
            "model_type": "lightgbm",
            "objective_type": "quantile",
            "quantile": 0.9,
            "last_model_load": at,
        }
        n = len(rows)
        body: dict[str, Any] = {
            "predictions": [answer] * n,
            "total_requests": n,
            "successful_predictions": n,
            "failed_predictions": 0,
            "processing_time_ms": 0.0,
        }
        return Response(orjson.dumps(body), media_type="application/json")

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ready"}

    return app


class FloorServicer(pb_grpc.PredictorServicer):
    """A gRPC servicer answering PredictBulk with constants after `work_s` of busy work."""

    def __init__(self, work_s: float) -> None:
        self.work_s = work_s

    def PredictBulk(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 (gRPC's name)
        """Constant predictions, one per row."""
        n = len(request.rows) or len(request.columns.input_token_length)
        busy(self.work_s)
        return pb.PredictBulkResponse(
            ttft_mean_ms=[100.0] * n,
            ttft_quantile_ms=[120.0] * n,
            tpot_mean_ms=[10.0] * n,
            tpot_quantile_ms=[12.0] * n,
            quantile=0.9,
            objective_type="quantile",
        )


def main() -> None:
    """Serve the floor apps on the given ports until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--work-us", type=float, default=0.0)
    args = parser.parse_args()
    work_s = args.work_us / 1e6
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_PredictorServicer_to_server(FloorServicer(work_s), server)
    server.add_insecure_port(f"127.0.0.1:{args.grpc_port}")
    server.start()
    try:
        uvicorn.run(create_floor_app(work_s), host="127.0.0.1", port=args.port, access_log=False, log_level="warning")
    finally:
        server.stop(grace=1.0).wait()


if __name__ == "__main__":
    main()
