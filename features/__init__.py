"""Leadtime's shared vocabulary: request and endpoint features, the accelerator catalog (and a deployment's own,
`catalog_file`), prefix hashing, vLLM metrics parsing and vectorization. Imports nothing else of Leadtime's but
`leadtime.yaml_text`, the reader every YAML file a user hands over goes through."""

from leadtime.features.catalog import (
    ACCELERATORS,
    BUILT_IN,
    MODELS,
    Accelerator,
    Catalog,
    ModelProfile,
    get_accelerator,
    get_model,
)
from leadtime.features.errors import FeatureError
from leadtime.features.rows import (
    ROLES,
    TIMESLICE_STATES,
    EndpointState,
    FeatureRow,
    Observation,
    RequestFeatures,
    feature_row_from_llmd,
    feature_row_to_llmd,
    observation_from_llmd,
    observation_to_llmd,
)

__all__ = [
    "ACCELERATORS",
    "BUILT_IN",
    "MODELS",
    "ROLES",
    "TIMESLICE_STATES",
    "Accelerator",
    "Catalog",
    "EndpointState",
    "FeatureError",
    "FeatureRow",
    "ModelProfile",
    "Observation",
    "RequestFeatures",
    "feature_row_from_llmd",
    "feature_row_to_llmd",
    "get_accelerator",
    "get_model",
    "observation_from_llmd",
    "observation_to_llmd",
]
