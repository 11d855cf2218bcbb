"""Liveness, readiness, status and Prometheus metrics: answered in every role."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from leadtime.predictor.llmd_importances import llmd_importances
from leadtime.predictor.service.edge import Runtime
from leadtime.predictor.service.runtime import ServiceRuntime, rfc3339
from leadtime.predictor.service.schemas import Readiness, content_of

# Included without the common 503: these paths answer while the service starts and stops (/readyz says so itself).
router = APIRouter(tags=["health"])


@router.get("/", summary="What is running here (llm-d's servers answer this too).")
async def root(runtime: Runtime) -> dict[str, Any]:
    """A message that the predictor runs, its model and objective, as llm-d's servers answer `/`."""
    s = runtime.settings
    return {
        "message": f"Leadtime latency predictor is running ({s.role} role)",
        "model_type": "lightgbm",
        "objective_type": s.objective,
        "quantile": s.quantile,
        "description": "TTFT/TPOT predictions per candidate endpoint, learned online; llm-d-compatible API, "
        "native API under /v1, docs at /docs",
    }


# Load balancers and `curl -I` probe with HEAD. Each HEAD decorator sits above its GET one, so that the GET route is
# registered first: a 405 names the methods of the first route with the path, which would otherwise be HEAD alone.
@router.head("/healthz", include_in_schema=False)
@router.get("/healthz", summary="The process is alive.")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.head("/readyz", include_in_schema=False)
@router.get(
    "/readyz",
    responses={
        200: {"model": Readiness, "description": "Predictions can be served; anything degraded is named."},
        503: {"model": Readiness, "description": "Predictions cannot be served yet (or any longer)."},
    },
    summary="200 while predictions can be served (naming anything degraded), else 503.",
)
async def readyz(runtime: Runtime) -> JSONResponse:
    """Readiness is about answering predictions. A Redis outage or a refused model degrades learning and
    sharing, not serving: answering 503 then would make Kubernetes pull every replica out of rotation at once
    over a dependency the hot path does not need. So degraded parts are named in a 200 answer."""
    health = runtime.health()
    degraded = {name: state for name, state in health.items() if state != "ok"}
    ingestion = runtime.ingestion()
    if runtime.ready:
        return JSONResponse({"status": "ready", "degraded": degraded, "components": health, "ingestion": ingestion})
    degraded.setdefault("predictor", "not started")
    body = {"status": "not ready", "degraded": degraded, "components": health, "ingestion": ingestion}
    return JSONResponse(body, status_code=503)


@router.head("/status", include_in_schema=False)
@router.get("/status", summary="llm-d's status answer, plus Leadtime's model and store state.")
async def status(runtime: Runtime) -> dict[str, Any]:
    """llm-d's status answer, plus Leadtime's model and store state."""
    predictor = runtime.predictor
    s = runtime.settings
    answer: dict[str, Any] = {
        "is_ready": runtime.ready,
        "model_type": "lightgbm",
        "objective_type": s.objective,
        "quantile": s.quantile,
        "last_model_load": rfc3339(predictor.last_model_load) if predictor is not None else None,
        "models_exist": {"ttft_model": predictor is not None, "tpot_model": predictor is not None},
        "ensemble_active": False,
        "role": s.role,
        "replica_id": runtime.replica_id,
        "holds_training_lease": runtime.holds_lease,
        "registry_version": runtime.store_version,
        "components": runtime.health(),
        "ingestion": runtime.ingestion(),
    }
    if predictor is not None:
        st = runtime.model_status()
        answer.update(
            model_version=predictor.version,
            observations=st.get("observations"),
            window=st.get("window"),
            trees_active=st.get("trees_active"),
            last_retrain=rfc3339(st.get("last_retrain")),
        )
    return answer


@router.head("/metrics", include_in_schema=False)
@router.get(
    "/metrics", responses=content_of("text/plain", "Prometheus text format."), summary="Prometheus text format."
)
async def metrics(runtime: Runtime) -> Response:
    """Prometheus text: Leadtime's metrics, plus llm-d's training-server lines in the training role."""
    # In a worker thread: the trees' importances (LightGBM parses a tree loaded as text on first use) and the
    # rendering take milliseconds, and Prometheus scrapes while the event loop answers predictions.
    return Response(await asyncio.to_thread(_metrics_text, runtime), media_type=CONTENT_TYPE_LATEST)


def _metrics_text(runtime: ServiceRuntime) -> bytes:
    """What /metrics answers. Blocking: called in a worker thread."""
    llmd = None
    if runtime.settings.serves_training:
        samples = runtime.samples
        predictor = runtime.predictor
        importances = {}
        if predictor is not None:
            for target in ("ttft", "tpot"):
                raw = predictor.tree_importances(target)
                importances[target] = llmd_importances(target, raw) if raw else {}
        llmd = {
            "objective": runtime.settings.objective,
            "quantile": runtime.settings.quantile,
            "samples": dict(samples.train),  # training samples: the held-out test ones apart, as its HELP says
            "importances": importances,
        }
    return runtime.metrics.render(llmd)
