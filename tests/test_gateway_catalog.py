"""`leadtime route --catalog FILE`: endpoints labelled with classes only the catalog knows are discovered, scored
and routed to; without the catalog their labels are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from leadtime.bench.procs import Route, SimFleet
from leadtime.cli import app
from leadtime.features.catalog_file import load_catalog
from leadtime.router_plugin.discovery import DiscoveryError, parse_static, read_endpoints_file

FLEET = {
    "name": "two",
    "pools": [{"name": "gpu", "count": 2, "accelerator": "h100-sxm", "model": "llama-3.1-8b"}],
}


def test_endpoint_labels_name_classes_of_the_catalog(catalog_file: Path, tmp_path: Path) -> None:
    spec = "127.0.0.1:8100,name=l4-0,leadtime.io/accelerator=l4,leadtime.io/model=qwen2.5-7b"
    with pytest.raises(DiscoveryError, match=r"endpoint 1 \(.*\): leadtime.io/accelerator: unknown accelerator"):
        parse_static([spec])
    (endpoint,) = parse_static([spec], load_catalog(catalog_file))
    assert endpoint.base_state().accelerator == "l4" and endpoint.base_state().model == "qwen2.5-7b"
    path = tmp_path / "endpoints.yaml"
    path.write_text(yaml.safe_dump({"endpoints": [{"name": "b", "address": "127.0.0.1", "port": 8101,
                                                   "labels": {"leadtime.io/accelerator": "b200"}}]}))  # fmt: skip
    with pytest.raises(DiscoveryError, match="unknown accelerator class 'b200'"):
        read_endpoints_file(path)
    assert read_endpoints_file(path, catalog=load_catalog(catalog_file))[0].endpoint_id == "b"


@pytest.mark.parametrize(
    "label", ["leadtime.io/accelerator=b200", "leadtime.io/model=qwen2.5-7b"], ids=["accelerator", "model"]
)
def test_a_label_naming_what_the_gateway_does_not_know_says_how_to_describe_it(label: str) -> None:
    """Regression: `--accelerator b200` said that others can be described in a catalog file, but an endpoint's label
    naming b200, which a fleet of them meets first, listed the known classes alone."""
    with pytest.raises(DiscoveryError) as err:
        parse_static([f"127.0.0.1:8100,{label}"])
    assert str(err.value).endswith("; others can be described in a catalog file (--catalog FILE)"), err.value


@pytest.mark.parametrize(
    ("catalog_text", "args", "names"),
    [
        ("accelerators: 3\n", [], ["--catalog", "accelerators: Input should be a valid list"]),
        (
            None,
            ["--accelerator", "b300"],
            ["--accelerator: unknown accelerator class 'b300'", "b200", "--catalog FILE"],
        ),
    ],
)
def test_route_refuses_a_bad_catalog_in_one_line(
    catalog_file: Path, catalog_text: str | None, args: list[str], names: list[str]
) -> None:
    if catalog_text is not None:
        catalog_file.write_text(catalog_text)
    result = CliRunner().invoke(app, ["route", "--endpoint", "127.0.0.1:8100", "--catalog", str(catalog_file), *args])
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1, result.output
    for name in names:
        assert name in result.output, result.output


def test_the_gateway_routes_to_endpoints_of_catalog_classes(catalog_file: Path, tmp_path: Path) -> None:
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(FLEET))
    fleet = SimFleet(tmp_path / "fleet.yaml", tmp_path)
    route = None
    try:
        endpoints = fleet.endpoints
        for endpoint, accelerator in zip(endpoints, ("l4", "b200"), strict=True):
            endpoint["labels"]["leadtime.io/accelerator"] = accelerator
        discovery = tmp_path / "catalog-endpoints.yaml"
        discovery.write_text(yaml.safe_dump({"endpoints": endpoints}))
        args = ["--discovery", str(discovery), "--catalog", str(catalog_file), "--embedded"]
        route = Route(tmp_path, args).wait()
        for i in range(6):
            body = {"prompt": f"request {i} " * 50, "max_tokens": 4}
            answer = httpx.post(f"{route.url}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            assert json.loads(answer.text)["choices"]
        picks = {a: route.metric("leadtime_router_picks_total", accelerator=a) for a in ("l4", "b200")}
        assert sum(picks.values()) == 6, picks
    finally:
        if route is not None:
            route.child.stop()
        fleet.stop()
