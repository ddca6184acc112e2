"""The dashboard's shape (templated on datasource and replica) and the docs: every metric
kvgate exports and every alert is documented. No Prometheus needed."""

from __future__ import annotations

import json
import re

import yaml

from kvgate.balancer.replica_metrics import MIRRORED
from kvgate.proxy.metrics import KvgateMetrics
from tests.observability.helpers import ALERT_RULES, DASHBOARD, REPO, dashboard_queries

DOCS = REPO / "docs" / "observability.md"
METRIC = re.compile(r"\b(kvgate_[a-z_]+)")


def exported_metric_names() -> set[str]:
    """Every family on a proxy's registry, as Prometheus names it (`_total` on counters)."""
    metrics = KvgateMetrics()
    names = set()
    for family in metrics.registry.collect():
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    names.update(m.name + "_total" if m.kind == "counter" else m.name for m in MIRRORED)
    return names


def test_dashboard_is_templated_on_datasource_and_replica():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    replica = variables["replica"]
    assert replica["type"] == "query" and replica["includeAll"] and replica["multi"]
    assert replica["datasource"]["uid"] == "${datasource}"
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            if "kvgate_turn_seconds" not in target["expr"]:  # the one family without a replica label
                assert 'replica=~"$replica"' in target["expr"], panel["title"]


def test_dashboard_reads_only_metrics_that_kvgate_exports():
    known = exported_metric_names()
    for title, expr in dashboard_queries(json.loads(DASHBOARD.read_text())):
        for name in METRIC.findall(expr):
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in known or family in known, f"{title}: {name} is not exported by kvgate"


def test_docs_list_every_metric_and_every_alert():
    text = DOCS.read_text()
    documented = set(METRIC.findall(text))
    missing = {n for n in exported_metric_names() if n not in documented}
    assert not missing, f"docs/observability.md does not list {sorted(missing)}"
    for agreed in ("kvgate_window_ends_total", "kvgate_gate_conflict"):
        assert agreed in documented
    for group in yaml.safe_load(ALERT_RULES.read_text())["groups"]:
        for rule in group["rules"]:
            assert f"### {rule['alert']}" in text, f"no section for {rule['alert']}"


def test_readme_links_the_observability_docs():
    assert "docs/observability.md" in (REPO / "README.md").read_text()
