"""Leadtime: latency-prediction routing for LLM serving fleets.

One import package. Its subpackages are the folders of the repository (`features/`, `predictor/`,
`router_plugin/`, `training/`, `simulator/`, `bench/`, `data/`), linked into this folder so that a checkout, an
editable install and a wheel all import them by the same names (`leadtime.features`, ...).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("leadtime")
except PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0+unknown"
