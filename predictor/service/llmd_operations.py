"""llm-d's operations paths: /reload, model listing, info, downloads, LightGBM text and importances, export.

Downloads are JSON with LightGBM text embedded, never pickles (llm-d ships joblib pickles; this is the one
place Leadtime deliberately differs): a model fetched from here is data and cannot run code when loaded.
"""

from __future__ import annotations

import asyncio
import io
import json
import tarfile
import threading
import time
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request, Response

from leadtime.features.vectorize import COLUMNS
from leadtime.predictor.artifact import ArtifactError
from leadtime.predictor.llmd_importances import llmd_importances
from leadtime.predictor.service.edge import ReadyRuntime, require_token
from leadtime.predictor.service.runtime import ServiceRuntime, rfc3339
from leadtime.predictor.service.schemas import MODEL_REFUSED, NOT_FOUND, content_of

prediction_router = APIRouter(tags=["llm-d operations"])
training_router = APIRouter(tags=["llm-d operations"])

RELOAD_PATH = "/reload"
MODEL_NAMES = ("ttft", "tpot", "ttft_gated", "tpot_gated")
TARGETS = ("ttft", "tpot")


class ModelDocuments:
    """The downloadable documents of the serving model, built once per model installed.

    llm-d's prediction servers ask for /model/{name}/download every second, and its tooling lists and describes the
    models (sizes included) as often: each used to encode the whole model and parse it back, 80 ms and more on the
    event loop with a large window. The documents are cut from `ServiceRuntime.serving_artifact` (the bytes
    `/v1/model` serves, encoded once per model installed) and kept while its digest is the serving one.
    One per app (`create_app` makes it); blocking: called in a worker thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cached: tuple[str, float, dict[str, bytes]] | None = None

    def of(self, runtime: ServiceRuntime) -> dict[str, bytes]:
        """Target -> its document, for the model serving now."""
        artifact, digest, _ = runtime.serving_artifact()
        quantile = runtime.settings.quantile
        with self._lock:
            cached = self._cached
            if cached is None or cached[0] != digest or cached[1] != quantile:
                cached = (digest, quantile, _target_documents(artifact, quantile))
                self._cached = cached
        return cached[2]


def _model_documents(request: Request) -> ModelDocuments:
    documents: ModelDocuments = request.app.state.model_documents
    return documents


Documents = Annotated[ModelDocuments, Depends(_model_documents)]


def _target_documents(artifact: bytes, quantile: float) -> dict[str, bytes]:
    """Each target's downloadable form, cut from the serving model's artifact."""
    state: dict[str, Any] = json.loads(artifact)
    documents = {}
    for name in TARGETS:
        document = {
            "format": "leadtime-target-model",
            "target": name,
            "model_type": "lightgbm",
            "quantile": quantile,
            "schema_version": state.get("schema_version"),
            "columns": list(COLUMNS),
            "version": state.get("version"),
            "state": state["targets"][name],
        }
        documents[name] = json.dumps(document, separators=(",", ":")).encode()
    return documents


async def _target_document(runtime: ServiceRuntime, cache: ModelDocuments, name: str) -> bytes | None:
    """The downloadable form of one model, or None if it does not exist (the gated models never do)."""
    if name not in TARGETS:
        return None
    # In a worker thread: the first ask after a model is installed encodes it, and the loop answers predictions.
    documents = await asyncio.to_thread(cache.of, runtime)
    return documents[name]


def _last_modified(runtime: ServiceRuntime) -> str:
    predictor = runtime.predictor
    moment = predictor.last_model_load if predictor is not None else None
    return rfc3339(moment) or datetime.fromtimestamp(runtime.started_at, UTC).isoformat()


def _path(runtime: ServiceRuntime, name: str) -> str:
    if runtime.settings.model_dir is not None:
        return f"{runtime.settings.model_dir}/leadtime-predictor.json#{name}"
    return f"memory://{name}"


def _check_name(name: str) -> None:
    if name not in MODEL_NAMES:
        raise HTTPException(404, f"unknown model {name!r}; models are {', '.join(MODEL_NAMES)}")


@prediction_router.post(
    RELOAD_PATH,
    dependencies=[Depends(require_token)],
    responses=MODEL_REFUSED,
    summary="Swap in the newest published model now.",
)
async def reload(runtime: ReadyRuntime) -> dict[str, Any]:
    """Load the newest published model now (llm-d's /reload). With --model-from, pull the source's model first
    (`pulled`: what the pull did): the process's own store holds only what was pulled, up to a second ago."""
    pulled = await asyncio.to_thread(runtime.pull_model_now)
    if pulled is not None and pulled[0] == "refused":
        raise HTTPException(409, f"the model pulled was refused: {pulled[1]}")
    if pulled is not None and pulled[0] == "error":
        raise HTTPException(503, f"the model source cannot be pulled from: {pulled[1]}")
    try:
        # In a worker thread: loading a model waits for the registry and for the learner's pipe, and the event
        # loop must keep answering predictions meanwhile.
        await asyncio.to_thread(runtime.sync_model_dir)  # a model another process wrote to --model-dir
        synced, loaded = await asyncio.to_thread(runtime.sync_from_store)
    except ArtifactError as err:
        raise HTTPException(409, f"the newest published model was refused: {err}") from None
    except OSError as err:  # the store's outages (StoreUnavailable is a ConnectionError); anything else is a bug (500)
        raise HTTPException(503, f"the model registry is unreachable: {err}") from None
    if pulled is not None and pulled[0] == "new":
        loaded = True  # swapped in by the call above, or by the model sync a moment before it: serving either way
    predictor = runtime.predictor
    assert predictor is not None
    return {
        "synced": synced,
        "loaded": loaded,
        **({"pulled": pulled[0]} if pulled is not None else {}),
        "is_ready": True,
        "model_type": "lightgbm",
        "objective_type": runtime.settings.objective,
        "quantile": runtime.settings.quantile,
        "last_load_time": rfc3339(predictor.last_model_load),
        "model_version": predictor.version,
    }


@training_router.get("/models/list", summary="Every model name llm-d knows, with whether it exists here.")
async def models_list(runtime: ReadyRuntime, cache: Documents) -> dict[str, Any]:
    """Every model name llm-d's tooling asks for, with whether it exists, its size and age."""
    documents = await asyncio.to_thread(cache.of, runtime)  # in a worker thread: see `_target_document`
    models = {}
    for name in MODEL_NAMES:
        document = documents.get(name)
        models[name] = {
            "exists": document is not None,
            "size_bytes": len(document) if document is not None else 0,
            "last_modified": _last_modified(runtime) if document is not None else None,
        }
    return {
        "models": models,
        "model_type": "lightgbm",
        "quantile": runtime.settings.quantile,
        "server_time": datetime.now(UTC).isoformat(),
    }


@training_router.get("/model/download/info", summary="What can be downloaded, and from where.")
async def download_info(runtime: ReadyRuntime) -> dict[str, Any]:
    """llm-d's /model/download/info: model type, quantile, where each model can be fetched."""
    predictor = runtime.predictor
    assert predictor is not None
    trees = predictor.status().get("trees_active", {})
    return {
        "model_type": "lightgbm",
        "quantile": runtime.settings.quantile,
        "objective_type": runtime.settings.objective,
        "available_endpoints": {
            "ttft": "/model/ttft/download",
            "tpot": "/model/tpot/download",
            "ttft_lgb_txt": "/model/ttft/lgb/txt",
            "tpot_lgb_txt": "/model/tpot/lgb/txt",
            "ttft_importances": "/model/ttft/lgb/importances",
            "tpot_importances": "/model/tpot/lgb/importances",
            "export": "/model/export",
        },
        "model_status": {  # flags only, as llm-d's: a client may read it as name -> bool
            "ttft_model": True,
            "tpot_model": True,
            "ttft_trees": bool(trees.get("ttft")),
            "tpot_trees": bool(trees.get("tpot")),
        },
        "model_version": predictor.version,
        "last_model_load": rfc3339(predictor.last_model_load),
    }


@training_router.get(
    "/model/{name}/info", responses=NOT_FOUND, summary="Size, age and location of one model (404 if unknown)."
)
async def model_info(name: str, runtime: ReadyRuntime, cache: Documents) -> dict[str, Any]:
    """One model's size, age and path (404 for a name llm-d does not use)."""
    _check_name(name)
    document = await _target_document(runtime, cache, name)
    return {
        "model_name": name,
        "path": _path(runtime, name),
        "size_bytes": len(document) if document is not None else 0,
        "last_modified": _last_modified(runtime) if document is not None else None,
        "exists": document is not None,
        "model_type": "lightgbm",
        "quantile": runtime.settings.quantile,
    }


@training_router.get(
    "/model/{name}/download", responses=NOT_FOUND, summary="One model as JSON with embedded LightGBM text."
)
async def model_download(name: str, runtime: ReadyRuntime, cache: Documents) -> Response:
    """The model's artifact bytes: JSON with LightGBM text inside, never a pickle."""
    _check_name(name)
    document = await _target_document(runtime, cache, name)
    if document is None:
        raise HTTPException(404, f"model {name!r} does not exist on this server (Leadtime has no gated models)")
    return Response(
        document,
        media_type="application/json",
        headers={"Content-Disposition": f'attachment; filename="{name}.json"'},
    )


def _check_target(target: str) -> None:
    if target not in TARGETS:
        raise HTTPException(404, f"unknown target {target!r}; targets are ttft, tpot")


@training_router.get(
    "/model/{target}/lgb/txt",
    responses={**NOT_FOUND, **content_of("text/plain", "LightGBM's text model format.")},
    summary="The LightGBM text model serving now (404 if none yet).",
)
async def lgb_text(target: str, runtime: ReadyRuntime) -> Response:
    """The serving LightGBM tree of a target as text (404 while none serves)."""
    _check_target(target)
    predictor = runtime.predictor
    assert predictor is not None
    text = await asyncio.to_thread(predictor.tree_text, target)  # LightGBM writes a large model in milliseconds
    if text is None:
        raise HTTPException(
            404,
            f"no LightGBM tree serves {target} yet: the window has not produced an accepted "
            "retrain (predictions come from the physics prior and the online correction)",
        )
    return Response(text, media_type="text/plain; charset=utf-8")


@training_router.get(
    "/model/{target}/lgb/importances",
    responses=NOT_FOUND,
    summary="Share of the trees' gain per llm-d input (404 while no tree serves).",
)
async def lgb_importances(target: str, runtime: ReadyRuntime) -> dict[str, float]:
    """Keyed by llm-d's input names: Leadtime's features are summed onto the inputs they are derived from
    (`leadtime.predictor.llmd_importances`); Leadtime's own features (accelerator, time-slice) keep their names."""
    _check_target(target)
    predictor = runtime.predictor
    assert predictor is not None
    # In a worker thread: a tree loaded as text is parsed by LightGBM on first use, milliseconds for a large one.
    importances = await asyncio.to_thread(predictor.tree_importances, target)
    if not importances:
        raise HTTPException(
            404,
            f"no LightGBM tree serves {target} yet, so it has no feature importances (predictions come from the "
            "physics prior and the online correction)",
        )
    return llmd_importances(target, importances)


@training_router.get(
    "/model/export",
    responses=content_of("application/gzip", "A gzip tar of the models."),
    summary="A gzip tar of the current models and metadata.json.",
)
async def model_export(runtime: ReadyRuntime) -> Response:
    """A gzip tar of the current models and metadata.json: a seed for a new deployment."""
    # In a worker thread: encoding the model, writing its trees as text and compressing them take a quarter of a
    # second with a large window, and the event loop must keep answering predictions meanwhile.
    archive = await asyncio.to_thread(_export_archive, runtime)
    return Response(
        archive,
        media_type="application/gzip",
        headers={"Content-Disposition": 'attachment; filename="leadtime-models.tar.gz"'},
    )


def _export_archive(runtime: ServiceRuntime) -> bytes:
    """The gzip tar `/model/export` answers. Blocking: called in a worker thread."""
    artifact, _, version = runtime.serving_artifact()  # encoded once per model installed
    predictor = runtime.predictor
    assert predictor is not None
    if predictor.version != version:  # another model was installed meanwhile: its trees go with its own artifact
        artifact, version = predictor.to_bytes(), predictor.version
    files: dict[str, bytes] = {"leadtime-predictor.json": artifact}
    for target in TARGETS:
        text = predictor.tree_text(target)
        if text is not None:
            files[f"{target}.lgb.txt"] = text.encode()
    metadata = {
        "model_type": "lightgbm",
        "objective_type": runtime.settings.objective,
        "quantile_alpha": runtime.settings.quantile,
        "exported_at": datetime.now(UTC).isoformat(),
        "model_version": version,
        "files": sorted(files),
    }
    files["metadata.json"] = json.dumps(metadata, indent=2).encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
