"""The serving stack with nothing behind it: what `leadtime bench serving` compares the service against.

The same FastAPI + uvicorn (httptools, uvloop) and grpcio servers the service runs, answering the same paths with
answers of the same size and shape, but without validating rows or predicting anything. Measured side by side
with the service in one run, it shows how much of a latency percentile is the stack and the machine (on a shared
2-core machine, most of p99) and how much is Leadtime's own work.

    python -m bench.stack_floor --port P --grpc-port G
"""

from __future__ import annotations

import argparse
from concurrent import futures
from datetime import UTC, datetime
from typing import Any

import grpc
import orjson
import uvicorn
from fastapi import FastAPI, Request, Response

from predictor.grpc import leadtime_pb2 as pb
from predictor.grpc import leadtime_pb2_grpc as pb_grpc


def create_floor_app() -> FastAPI:
    app = FastAPI()

    @app.post("/predict/bulk/strict")
    async def predict_bulk_strict(request: Request) -> Response:
        rows = orjson.loads(await request.body())["requests"]
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
    def PredictBulk(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 (gRPC's name)
        n = len(request.rows)
        return pb.PredictBulkResponse(
            ttft_mean_ms=[100.0] * n,
            ttft_quantile_ms=[120.0] * n,
            tpot_mean_ms=[10.0] * n,
            tpot_quantile_ms=[12.0] * n,
            quantile=0.9,
            objective_type="quantile",
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    args = parser.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_PredictorServicer_to_server(FloorServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{args.grpc_port}")
    server.start()
    try:
        uvicorn.run(create_floor_app(), host="127.0.0.1", port=args.port, access_log=False, log_level="warning")
    finally:
        server.stop(grace=1.0).wait()


if __name__ == "__main__":
    main()
