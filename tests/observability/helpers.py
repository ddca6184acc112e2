"""What the observability tests share: the files under test and reading the dashboard.
Fixtures (Prometheus and promtool): conftest.py."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO / "docker" / "prometheus"
ALERT_RULES = PROMETHEUS_DIR / "kvgate-alerts.yml"
ALERT_TESTS = PROMETHEUS_DIR / "kvgate-alerts.test.yml"
DASHBOARD = REPO / "docker" / "grafana" / "kvgate.json"


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel, rows' nested panels included."""
    queries = []

    def walk(panels):
        for panel in panels:
            walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                queries.append((f"{panel['title']} [{target['refId']}]", target["expr"]))

    walk(dashboard["panels"])
    return queries
