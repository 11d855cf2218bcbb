"""Settings: defaults, LEADTIME_* environment variables, explicit values first, clear refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from leadtime.predictor.settings import ServiceSettings


def test_defaults_match_the_issue() -> None:
    s = ServiceSettings()
    assert (s.host, s.port, s.grpc_port) == ("127.0.0.1", 8000, 50051)
    assert s.redis_url is None and s.role == "all" and s.objective == "quantile" and s.quantile == 0.9
    assert s.serves_prediction and s.serves_training


def test_every_option_reads_its_environment_variable() -> None:
    env = {
        "LEADTIME_HOST": "0.0.0.0",
        "LEADTIME_PORT": "9000",
        "LEADTIME_GRPC_PORT": "0",
        "LEADTIME_REDIS_URL": "redis://127.0.0.1:6390/0",
        "LEADTIME_ROLE": "training",
        "LEADTIME_OBJECTIVE": "mean",
        "LEADTIME_QUANTILE": "0.95",
        "LEADTIME_MODEL_DIR": "/tmp/models",
        "LEADTIME_API_TOKEN": "t",
        "LEADTIME_ACCELERATOR": "l40s",
        "LEADTIME_MODEL": "qwen3-32b",
        "LEADTIME_MAX_BODY_BYTES": "1024",
    }
    s = ServiceSettings.from_env(env=env)
    assert (s.host, s.port, s.grpc_port, s.redis_url) == ("0.0.0.0", 9000, 0, "redis://127.0.0.1:6390/0")
    assert (s.role, s.objective, s.quantile) == ("training", "mean", 0.95)
    assert s.model_dir == Path("/tmp/models") and s.api_token == "t"
    assert (s.accelerator, s.model, s.max_body_bytes) == ("l40s", "qwen3-32b", 1024)
    assert s.serves_training and not s.serves_prediction
    assert ServiceSettings.from_env({"port": 7000, "host": None}, env=env).port == 7000  # explicit wins


def test_bad_values_are_refused_naming_the_option() -> None:
    with pytest.raises(ValidationError, match="role"):
        ServiceSettings.from_env(env={"LEADTIME_ROLE": "both"})
    with pytest.raises(ValidationError, match="quantile"):
        ServiceSettings(quantile=1.5)
    with pytest.raises(ValidationError, match="finite number"):  # not "should be less than 1"
        ServiceSettings.from_env(env={"LEADTIME_QUANTILE": "nan"})
    with pytest.raises(ValidationError, match="port"):
        ServiceSettings.from_env(env={"LEADTIME_PORT": "eighty"})


def test_a_window_too_small_for_a_first_tree_is_refused_as_a_setting() -> None:
    """The service's learner needs `min_window` rows in its window for a tree: a smaller window was accepted here
    and then refused by LearnerConfig, a traceback at start rather than a message naming the setting."""
    from leadtime.predictor.learner import LearnerConfig

    least = LearnerConfig().min_window
    with pytest.raises(ValidationError, match=f"window\n.*{least}"):
        ServiceSettings.from_env(env={"LEADTIME_WINDOW": str(least - 1)})
    assert ServiceSettings(window=least).window == least


@pytest.mark.parametrize("variable", ["LEADTIME_REDIS_URL", "LEADTIME_MODEL_DIR"])
def test_a_variable_saying_where_state_lives_set_but_blank_is_refused(variable: str) -> None:
    """`LEADTIME_REDIS_URL=` (a ConfigMap key left empty) started the service on its in-memory store: replicas
    shared no model and no observation, and a restart lost what was learned, with one info line to say so."""
    for blank in ("", " "):
        with pytest.raises(ValueError, match=f"{variable} is set but empty"):
            ServiceSettings.from_env(env={variable: blank})
    assert ServiceSettings.from_env(env={"LEADTIME_PORT": ""}).port == 8000  # others: empty is unset


@pytest.mark.parametrize(
    "variable",
    # A CA file set but empty was read as unset: a --model-from over HTTPS then verified the source against the
    # system's CAs and failed every pull, naming no variable.
    ["LEADTIME_API_TOKEN", "LEADTIME_TLS_CERTFILE", "LEADTIME_TLS_KEYFILE", "LEADTIME_MODEL_FROM_CA_FILE"],
)
def test_a_secret_variable_set_but_blank_is_refused_where_the_environment_is_read(variable: str) -> None:
    """The refusal lived in the CLI alone: `create_app(ServiceSettings.from_env())`, with `LEADTIME_API_TOKEN=`
    from a Secret missing its key, served with the write paths open. A value given for the field wins."""
    with pytest.raises(ValueError, match=f"{variable} is set but empty"):
        ServiceSettings.from_env(env={variable: " "})
    field = variable.removeprefix("LEADTIME_").lower()
    assert ServiceSettings.from_env({"api_token": "t"}, env={"LEADTIME_API_TOKEN": ""}).api_token == "t"
    assert field in ServiceSettings.model_fields


def test_allowed_hosts_read_their_variable_comma_separated_and_the_option_wins() -> None:
    env = {"LEADTIME_ALLOWED_HOSTS": "Leadtime.svc, 10.0.0.7 ,[::1],*.example.com"}
    assert ServiceSettings.from_env(env=env).allowed_hosts == ("leadtime.svc", "10.0.0.7", "::1", "*.example.com")
    assert ServiceSettings.from_env({"allowed_hosts": ("a.svc",)}, env=env).allowed_hosts == ("a.svc",)
    assert ServiceSettings.from_env(env={}).allowed_hosts == ()  # unset: every host, as before
    assert ServiceSettings.from_env({"allowed_hosts": ("a.svc",)}, env={"LEADTIME_ALLOWED_HOSTS": ""}).allowed_hosts


@pytest.mark.parametrize("value", ["", " ", "a.svc,,b.svc", "a.svc,", "localhost:8000", "http://a.svc"])
def test_an_allowed_hosts_variable_with_an_entry_no_host_could_match_is_refused(value: str) -> None:
    """Set but empty is refused, as a secret is: it would leave every Host answered where a list was meant."""
    with pytest.raises(ValueError, match="LEADTIME_ALLOWED_HOSTS is set but empty|allowed_hosts"):
        ServiceSettings.from_env(env={"LEADTIME_ALLOWED_HOSTS": value})


@pytest.mark.parametrize("token", ["t1,t2", "t1 t2", ""])
def test_a_token_holding_a_separator_is_refused_as_the_gateways_keys_are(token: str) -> None:
    """`leadtime route` lists keys apart by commas or spaces: a token holding one is a list given where the service
    takes one token, and the same check (`keys.check_key`) refuses it on both."""
    with pytest.raises(ValidationError, match=r"api_token\n.*without spaces, commas"):
        ServiceSettings(api_token=token)


@pytest.mark.parametrize(
    "variable",
    [
        "LEADTIME_LEASE_TTL_S",
        "LEADTIME_MIN_RETRAIN_INTERVAL_S",
        "LEADTIME_MODEL_SAVE_INTERVAL_S",
        "LEADTIME_SNAPSHOT_INTERVAL_S",
    ],
)
@pytest.mark.parametrize(("value", "problem"), [("inf", "finite number"), ("nan", "finite number"), ("1e12", "86400")])
def test_a_period_beyond_a_day_or_not_finite_is_refused_naming_it(variable: str, value: str, problem: str) -> None:
    """`LEADTIME_LEASE_TTL_S=inf` (or 1e12) passed: the lease thread then died on an OverflowError (Event.wait of
    inf / 3) while the service ran on; an infinite snapshot or retrain interval never snapshotted or retrained."""
    field = variable.removeprefix("LEADTIME_").lower()
    with pytest.raises(ValidationError, match=f"{field}\n.*{problem}"):
        ServiceSettings.from_env(env={variable: value})
    assert getattr(ServiceSettings.from_env(env={variable: "86400"}), field) == 86400


@pytest.mark.parametrize(
    ("variable", "largest"),
    [
        # gRPC takes the body limit as a C int: 2**31 was a 90-line OverflowError at start.
        ("LEADTIME_MAX_BODY_BYTES", 2**31 - 1),
        # The window's arrays are allocated at the first row: 1e12 started, then every batch failed to allocate
        # 167 TiB and nothing was ever learned, /readyz saying ready.
        ("LEADTIME_WINDOW", 1_000_000),
        # Redis's COUNT is a 64-bit integer: 1e20 started, then every read of observations failed.
        ("LEADTIME_INGEST_BATCH", 100_000),
    ],
)
def test_a_size_beyond_what_the_service_can_use_is_refused_at_start(variable: str, largest: int) -> None:
    field = variable.removeprefix("LEADTIME_").lower()
    assert getattr(ServiceSettings.from_env(env={variable: str(largest)}), field) == largest
    with pytest.raises(ValidationError, match=f"{field}\n.*less than or equal to {largest}"):
        ServiceSettings.from_env(env={variable: str(largest + 1)})


def test_a_path_setting_starting_with_a_tilde_is_the_home_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--model-dir=~/models` (a shell leaves the tilde after `=` as it is) and a service manager's
    `LEADTIME_MODEL_DIR=~/models` made a folder named `~` in the working directory: the model kept there was not
    where the user would look for it, nor found by the next start from elsewhere."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "cert.pem").write_text("x")
    (tmp_path / "key.pem").write_text("x")
    s = ServiceSettings.from_env(
        env={
            "LEADTIME_MODEL_DIR": "~/models",
            "LEADTIME_TLS_CERTFILE": "~/cert.pem",
            "LEADTIME_TLS_KEYFILE": "~/key.pem",
            "LEADTIME_MODEL_FROM_CA_FILE": "~/ca.pem",
        }
    )
    assert s.model_dir == tmp_path / "models"
    assert (s.tls_certfile, s.tls_keyfile, s.model_from_ca_file) == (
        tmp_path / "cert.pem",
        tmp_path / "key.pem",
        tmp_path / "ca.pem",
    )
