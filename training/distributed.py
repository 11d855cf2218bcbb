"""Fitting the residual trees on a Dask cluster, with LightGBM's Dask estimators (data-parallel training).

Each fold's fitting rows are scattered once to the workers, one interleaved share per worker (rows i, i + k,
i + 2k, ... for k workers, so every worker holds a sample of the whole period and their histogram bins agree),
and every setting and objective of the search is fitted on them in turn by `DaskLGBMRegressor`: the workers
build histograms over their shares and LightGBM's network merges them, so the trees are those of one fit over
all the rows (up to the bins each worker found). LightGBM's workers cannot stop early together, so each fit runs
every round and the round is chosen afterwards by the same rule (`early_stopping_round`) on the whole
validation curve, computed here a round at a time.

LightGBM's Dask code prints its port search on standard output; it is sent to standard error, so that a
`--json` answer stays the only thing on standard output.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import lightgbm as lgb
import numpy as np

from leadtime.predictor.trees import TREE_FEATURES
from leadtime.training.fit import early_stopping_round, truncated, validation_loss


class DaskUnavailable(RuntimeError):
    """dask.distributed is not installed, or the scheduler cannot be reached (one line)."""


HANDSHAKE_GRACE_S = 5.0
"""Beyond `connect`'s own timeout, how long a connected address may take to answer as a scheduler."""


def connect(address: str, timeout_s: float = 10.0) -> Any:
    """A `dask.distributed.Client` of the scheduler at `address` (``tcp://host:8786``)."""
    try:
        from dask.distributed import Client
    except ImportError:
        raise DaskUnavailable("--dask needs dask.distributed (pip install 'leadtime[retrain]')") from None
    # Made on a thread of its own, waited for with a deadline: an address that takes the connection but never
    # speaks Dask (Redis, the scheduler's dashboard) kept distributed's handshake waiting for ever, past `timeout`.
    made: list[Any] = []
    failed: list[BaseException] = []

    def make() -> None:
        try:
            made.append(Client(address, timeout=timeout_s))
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            failed.append(err)

    maker = threading.Thread(target=make, name="leadtime-dask-connect", daemon=True)
    maker.start()
    maker.join(timeout_s + HANDSHAKE_GRACE_S)
    if failed:
        err = failed[0]
        if isinstance(err, OSError | TimeoutError | ValueError):
            raise DaskUnavailable(f"cannot reach the Dask scheduler at {address}: {err}") from None
        if isinstance(err, Exception):  # another protocol's answer read as Dask frames: a MemoryError for exabytes
            raise DaskUnavailable(
                f"{address} did not answer as a Dask scheduler ({type(err).__name__}: {str(err)[:120]}; is it the "
                "scheduler's own address, tcp://HOST:8786?)"
            ) from None
        raise err
    if not made:
        raise DaskUnavailable(
            f"{address} did not answer as a Dask scheduler within {timeout_s + HANDSHAKE_GRACE_S:g} s (is it the "
            "scheduler's own address, tcp://HOST:8786?)"
        )
    return made[0]


@dataclass
class _Placed:
    x: Any  # dask.array.Array
    y: Any
    futures: list[Any]


class DaskTrainer:
    """Fits boosters with `lightgbm.DaskLGBMRegressor` on the cluster behind `client`.

    Parameters
    ----------
    client
        A connected `dask.distributed.Client`; the trainer neither starts nor closes it.
    """

    name = "dask"

    def __init__(self, client: Any) -> None:
        self.client = client

    @property
    def workers(self) -> int:
        """Workers the cluster has now."""
        return len(self.client.scheduler_info(n_workers=-1)["workers"])

    def prepare(self, x: np.ndarray, y: np.ndarray) -> _Placed:
        """Scatter the rows to the workers, one interleaved share each, as a dask array."""
        import dask.array as da

        workers = list(self.client.scheduler_info(n_workers=-1)["workers"])
        if not workers:
            raise DaskUnavailable("the Dask cluster has no workers")
        shares = [slice(i, None, len(workers)) for i in range(min(len(workers), len(y)))]
        futures = []
        x_parts, y_parts = [], []
        for share, worker in zip(shares, workers, strict=False):
            xs, ys = np.ascontiguousarray(x[share]), np.ascontiguousarray(y[share])
            fx, fy = self.client.scatter([xs, ys], workers=[worker])
            futures += [fx, fy]
            x_parts.append(da.from_delayed(fx, shape=xs.shape, dtype=xs.dtype))
            y_parts.append(da.from_delayed(fy, shape=ys.shape, dtype=ys.dtype))
        return _Placed(da.concatenate(x_parts), da.concatenate(y_parts), futures)

    def train(
        self,
        params: dict[str, Any],
        data: _Placed,
        x_valid: np.ndarray,
        y_valid: np.ndarray,
        rounds: int,
        patience: int,
    ) -> lgb.Booster:
        """Every round on the cluster, then truncated at the round early stopping would have kept."""
        # The workers' thread count is theirs (LightGBM's Dask code sets it per worker). `feature_pre_filter` stays
        # off, as in a local fit: with LightGBM's default (on) the workers' datasets dropped features the local
        # fit keeps, and the same rows and seed gave other trees.
        settings = {k: v for k, v in params.items() if k != "num_threads"}
        model = lgb.DaskLGBMRegressor(client=self.client, n_estimators=rounds)
        model.set_params(**settings)
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
            # The estimator's own n_jobs default is always reported as ignored: the workers' threads decide. This
            # catches it where LightGBM warns through `warnings` (its default); `leadtime retrain` gives LightGBM a
            # logger of its own instead, kept below ERROR.
            warnings.filterwarnings("ignore", message="Parameter n_jobs will be ignored", category=UserWarning)
            try:
                model.fit(data.x, data.y, feature_name=list(TREE_FEATURES))
            except Exception as err:  # LightGBM and distributed raise plain exceptions of many kinds
                raise DaskUnavailable(f"the fit on the Dask cluster failed: {' '.join(str(err).split())}") from err
        booster = model.booster_
        curve = _validation_curve(booster, params, x_valid, y_valid)
        return truncated(booster, early_stopping_round(curve, patience))

    def release(self, data: _Placed) -> None:
        """Drop the scattered shares from the workers' memory."""
        self.client.cancel(data.futures)

    def interrupted(self) -> None:
        """Ctrl-C: let the job exit 130 as quietly as a local run. The interrupt leaves the client's gather behind,
        its tasks waiting on the fit's futures; when the client closes they end in `AllExit` (distributed's own
        signal to stop waiting) with nothing left to retrieve it, and asyncio printed each as "Task exception was
        never retrieved" with a traceback. The client's loop drops those endings from now on (any other exception
        it reports as before), and distributed's own log of the connection cut short is kept below CRITICAL.

        Called only on the way out of an interrupted job, so the `distributed` logger left at CRITICAL for the rest
        of the process is acceptable; and nothing here may raise (a client without an event loop, say): its error
        would replace the KeyboardInterrupt."""
        with contextlib.suppress(Exception):
            self._quiet_interrupted_client()

    def _quiet_interrupted_client(self) -> None:
        from distributed.client import AllExit

        logging.getLogger("distributed").setLevel(logging.CRITICAL)
        loop = self.client.loop.asyncio_loop
        earlier = loop.get_exception_handler()

        def handler(loop: Any, context: dict[str, Any]) -> None:
            if isinstance(context.get("exception"), AllExit):
                return
            if earlier is not None:
                earlier(loop, context)
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(handler)


def _validation_curve(booster: lgb.Booster, params: dict[str, Any], x: np.ndarray, y: np.ndarray) -> list[float]:
    """The validation loss after every round: each round's trees predicted alone and summed up."""
    total = np.zeros(len(y))
    curve = []
    for i in range(booster.current_iteration()):
        total += np.asarray(booster.predict(x, start_iteration=i, num_iteration=1, num_threads=1))
        curve.append(validation_loss(params, y, total))
    return curve
