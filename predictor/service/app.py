"""The app factory: one place where the service is assembled from its routers, edge and runtime.

`create_app` builds everything per app (runtime, metrics registry, store unless given), so several apps
can live in one process (tests, two replicas) without sharing state. Background loops start in the lifespan
and stop cleanly on shutdown.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute

from leadtime.features.catalog import BUILT_IN
from leadtime.features.errors import FeatureError
from leadtime.predictor.learner import OnlinePredictor
from leadtime.predictor.service import health, llmd_operations, llmd_prediction, llmd_training, native
from leadtime.predictor.service.edge import (
    EdgeMiddleware,
    feature_error_handler,
    http_error_handler,
    require_token,
    store_closed_handler,
    unexpected_error_handler,
    validation_error_handler,
)
from leadtime.predictor.service.hot_path import NATIVE_PREDICT_PATH, STRICT_PATH, TRAINING_PATH, HotPath
from leadtime.predictor.service.llmd_operations import RELOAD_PATH
from leadtime.predictor.service.runtime import ServiceRuntime
from leadtime.predictor.service.schemas import COMMON_ERRORS, document_catalog, document_refusals
from leadtime.predictor.settings import ServiceSettings
from leadtime.predictor.store.base import Store, StoreClosed

API_VERSION = "1"
DOCS_ASSETS = "/docs/assets"  # where /docs and /redoc find their JavaScript, CSS and icon


class StoreError(ValueError):
    """The store the settings name cannot be used (a Redis URL that does not parse): one line, no credentials."""


def make_store(settings: ServiceSettings) -> tuple[Store, bool]:
    """The store the settings ask for, and whether the app owns it (and so closes it); StoreError for a Redis URL
    that cannot be used."""
    if settings.redis_url:
        from leadtime.predictor.store.redis_store import RedisStore

        try:
            # Rows still buffered at a stop (a Redis outage) are kept in the model directory, not dropped.
            return RedisStore(settings.redis_url, spill_dir=settings.model_dir), True
        except ValueError as err:  # RedisStore's own words name the URL without its password
            problem = str(err) if str(err).startswith("redis URL ") else f"the redis URL is not usable: {err}"
            raise StoreError(problem) from None
    from leadtime.predictor.store.memory import MemoryStore

    return MemoryStore(), True


OBSERVATION_PATHS = frozenset((TRAINING_PATH, "/v1/observations"))
"""The HTTP paths observations are accepted on: a batch whose sender hung up before it was accepted is not kept."""


def token_paths(routes: Iterable[BaseRoute]) -> frozenset[str]:
    """The paths that need the API token when one is configured: those whose route depends on `require_token`."""
    return frozenset(
        route.path
        for route in routes
        if isinstance(route, APIRoute) and any(d.call is require_token for d in route.dependant.dependencies)
    )


def write_paths(routes: Iterable[BaseRoute]) -> frozenset[str]:
    """The paths that change what the service learns (those that need the API token, but /reload, which takes no
    body and does what the service does by itself within a second): a JSON Content-Type is required there."""
    return token_paths(routes) - {RELOAD_PATH}


def create_app(
    settings: ServiceSettings | None = None,
    store: Store | None = None,
    predictor: OnlinePredictor | None = None,
) -> FastAPI:
    """The predictor service. `store` and `predictor` default to what `settings` describe."""
    settings = settings or ServiceSettings()
    own_store = False
    if store is None:
        store, own_store = make_store(settings)
    runtime = ServiceRuntime(settings, store, predictor, own_store=own_store)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime.start()
        try:
            yield
        finally:
            runtime.stop()

    # /docs and /redoc load their JavaScript and CSS from this process (the fastapi-offline package ships them),
    # not from a CDN: the pages work on a machine without Internet access.
    app = FastAPIOffline(
        title="Leadtime predictor",
        version=API_VERSION,
        description="TTFT/TPOT predictions for LLM serving fleets; a drop-in for llm-d's latency predictor.",
        lifespan=lifespan,
        static_url=DOCS_ASSETS,
    )
    app.state.runtime = runtime
    app.state.model_documents = llmd_operations.ModelDocuments()
    hot = HotPath(runtime)
    hot_paths: dict[str, Callable[[bytes, str], tuple[int, bytes] | None]] = {}
    if settings.serves_prediction:
        hot_paths[STRICT_PATH] = hot.predict_bulk_strict
        hot_paths[NATIVE_PREDICT_PATH] = hot.native_predict
    if settings.serves_training:
        hot_paths[TRAINING_PATH] = hot.add_training_data_bulk
    body_routers = []
    if settings.serves_prediction:
        body_routers += [llmd_prediction.router, llmd_operations.prediction_router, native.prediction_router]
    if settings.serves_training:
        body_routers += [llmd_training.router, llmd_operations.training_router, native.training_router]
    app.add_middleware(
        EdgeMiddleware,
        max_body_bytes=settings.max_body_bytes,
        runtime=runtime,
        hot_paths=hot_paths,
        mounts=(DOCS_ASSETS,),
        body_routes=[route for router in body_routers for route in router.routes],
        writes=write_paths(route for router in body_routers for route in router.routes),
        observation_paths=OBSERVATION_PATHS if settings.serves_training else frozenset(),
        allowed_hosts=settings.allowed_hosts,
    )
    app.add_exception_handler(FeatureError, feature_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(HTTPException, http_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(StoreClosed, store_closed_handler)
    app.add_exception_handler(Exception, unexpected_error_handler)
    app.include_router(health.router)
    app.include_router(native.common_router, responses=COMMON_ERRORS)
    for router in body_routers:
        app.include_router(router, responses=COMMON_ERRORS)
    routes = [route for router in (health.router, native.common_router, *body_routers) for route in router.routes]
    runtime.metrics.export_routes(
        (route.path, route.methods or (), route.status_code or 200) for route in routes if isinstance(route, APIRoute)
    )
    plain_openapi = app.openapi
    # The token's scheme and 401 are documented only where a configured token is needed.
    needing = token_paths(route for router in body_routers for route in router.routes) if settings.api_token else ()

    def openapi() -> dict[str, Any]:
        document = document_refusals(plain_openapi(), needing)  # FastAPI keeps the document made first
        return document if runtime.catalog == BUILT_IN else document_catalog(document, runtime.catalog)

    app.openapi = openapi  # type: ignore[method-assign]
    return app
