"""A fleet of a deployment's own classes (`--catalog FILE`) in the simulator: sized, stepped, routed and served by
its figures; without the catalog its pools are refused by name."""

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
from leadtime.simulator.engine import build_endpoints
from leadtime.simulator.fleet import FleetError, load_fleet

FLEET = {
    "name": "b200-and-h100",
    "pools": [
        {"name": "new", "count": 2, "accelerator": "b200", "model": "qwen2.5-7b"},
        {"name": "old", "count": 2, "accelerator": "h100-sxm", "model": "qwen2.5-7b"},
    ],
}


@pytest.fixture
def fleet_file(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(FLEET))
    return path


def test_a_fleet_of_catalog_classes_is_sized_and_stepped_by_their_figures(fleet_file: Path, catalog_file: Path) -> None:
    with pytest.raises(FleetError, match="unknown accelerator class 'b200'"):
        load_fleet(fleet_file)
    fleet = load_fleet(fleet_file, load_catalog(catalog_file))
    b200, h100 = fleet.endpoints[0], fleet.endpoints[2]
    assert (b200.accelerator, h100.accelerator) == ("b200", "h100-sxm")
    assert b200.kv_blocks > 2 * h100.kv_blocks  # 180 GB against 80, less the same 15 GB of weights
    steppers = {e.endpoint_id: e.stepper for e in build_endpoints(fleet)}
    prefill = [(4000, 0)]
    assert steppers[b200.endpoint_id].step_ms(prefill, 32, 32 * 2000) < steppers[h100.endpoint_id].step_ms(
        prefill, 32, 32 * 2000
    )


def test_simulate_routes_a_fleet_of_catalog_classes(fleet_file: Path, catalog_file: Path) -> None:
    args = ["simulate", "--fleet", str(fleet_file), "--max-requests", "150", "--json"]
    args += ["--policy", "leadtime", "--policy", "round-robin", "--catalog", str(catalog_file)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["requests"] == 150 and set(report["policies"]) == {"leadtime", "round_robin"}
    refused = CliRunner().invoke(app, args[:-2])
    assert refused.exit_code == 2 and len(refused.output.splitlines()) == 1, refused.output
    assert str(fleet_file) in refused.output and "unknown accelerator class 'b200'" in refused.output
    assert "catalog file (--catalog FILE)" in refused.output


def test_sim_serve_and_route_serve_a_fleet_of_catalog_classes(
    fleet_file: Path, catalog_file: Path, tmp_path: Path
) -> None:
    refused = CliRunner().invoke(app, ["sim", "serve", "--fleet", str(fleet_file)])
    assert refused.exit_code == 2 and "unknown accelerator class 'b200'" in refused.output
    fleet = SimFleet(fleet_file, tmp_path, catalog=catalog_file)
    route = None
    try:
        labels = {e["labels"]["leadtime.io/accelerator"] for e in fleet.endpoints}
        assert labels == {"b200", "h100-sxm"}
        route = Route(tmp_path, ["--discovery", str(fleet.endpoints_file), "--catalog", str(catalog_file),
                                 "--embedded"]).wait()  # fmt: skip
        for i in range(4):
            answer = httpx.post(f"{route.url}/v1/completions", json={"prompt": f"hi {i} " * 40, "max_tokens": 3})
            assert answer.status_code == 200, answer.text
        picks = sum(route.metric("leadtime_router_picks_total", accelerator=a) for a in labels)
        assert picks == 4
    finally:
        if route is not None:
            route.child.stop()
        fleet.stop()
