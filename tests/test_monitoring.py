"""docker/monitoring/: the Grafana dashboard and the Prometheus scrape configuration of the compose profile
"monitoring". Every query of the dashboard names only metrics a real `packfeed serve` exports (read from its
/metrics while a job streams), every exported metric is on the dashboard, the scrape targets cover the loaders'
metrics port range, and the compose profile (validated by the real Compose v2 binary) mounts these files.
Where `promtool` is installed it checks the scrape configuration too."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from test_docker import rendered

MONITORING = Path(__file__).resolve().parents[1] / "docker" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "packfeed.json"
METRIC = re.compile(r"\bpackfeed_[a-z_]+\b")


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queries += [variable["definition"] for variable in dashboard["templating"]["list"]]
    return queries


@pytest.fixture(scope="module")
def exported(small_tile_index) -> set[str]:
    """The sample names a live server's /metrics declares, read while a job streams."""
    from packfeed.client import LocalServer, PackStream
    from prometheus_client.parser import text_string_to_metric_families
    from ports import free_port

    port = free_port()
    with LocalServer(small_tile_index, workers=1, metrics_port=port) as server:
        with PackStream(server.target, job="watched", rank=0, dp=1, microbatches=1) as stream:
            next(iter(stream))
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",)}
    # a labelled metric with no series yet is still declared (HELP / TYPE): its sample names by its type
    return {family.name + suffix for family in text_string_to_metric_families(text)
            if family.name.startswith("packfeed_") for suffix in suffixes[family.type]}


def unexported(queries: list[str], exported: set[str]) -> set[str]:
    """Metric names the queries use that no server exports."""
    return {name for query in queries for name in METRIC.findall(query)} - exported


def test_every_query_names_an_exported_metric_and_every_metric_is_shown(exported):
    queries = dashboard_queries()
    named = {name for query in queries for name in METRIC.findall(query)}
    assert named, "the dashboard queries no Packfeed metric"
    assert not unexported(queries, exported), f"queries name metrics no server exports: {unexported(queries, exported)}"
    families = {re.sub(r"_(total|created|bucket|sum|count)$", "", name) for name in exported}
    shown = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in named}
    assert families <= shown, f"exported but on no panel: {sorted(families - shown)}"


def test_a_misspelt_metric_would_be_caught(exported):
    """The control: the same check flags a query whose metric the server does not export."""
    queries = dashboard_queries()
    misspelt = [q.replace("packfeed_packs_total", "packfeed_packs_sent_total") for q in queries]
    assert unexported(misspelt, exported) == {"packfeed_packs_sent_total"}


def test_panels_use_the_provisioned_data_source():
    datasource = yaml.safe_load((MONITORING / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
                                .read_text())["datasources"][0]
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {panel["datasource"]["uid"] for panel in dashboard["panels"]}
    uids |= {target["datasource"]["uid"] for panel in dashboard["panels"] for target in panel["targets"]}
    assert uids == {datasource["uid"]} and datasource["type"] == "prometheus"
    provider = yaml.safe_load((MONITORING / "grafana" / "provisioning" / "dashboards" / "packfeed.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_the_monitoring_profile_scrapes_every_port_of_the_loaders_range():
    services = rendered(profile="monitoring")["services"]
    assert {"prometheus", "grafana"} <= set(services)
    for name in ("prometheus", "grafana"):
        assert services[name]["network_mode"] == "host" and "ports" not in services[name]
    first, last = map(int, services["loader"]["environment"]["PACKFEED_METRICS_PORT"].split("-"))
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for group in job["static_configs"] for t in group["targets"]]
    assert sorted(targets) == [f"127.0.0.1:{port}" for port in range(first, last + 1)]
    mounts = {v["target"]: Path(v["source"]) for s in ("prometheus", "grafana") for v in services[s]["volumes"]
              if v["type"] == "bind"}
    assert mounts["/etc/prometheus/prometheus.yml"] == MONITORING / "prometheus.yml"
    assert (mounts["/var/lib/grafana/dashboards"] / "packfeed.json").is_file()
    assert (mounts["/etc/grafana/provisioning"] / "datasources" / "prometheus.yml").is_file()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_accepts_the_scrape_configuration():
    done = subprocess.run(["promtool", "check", "config", str(MONITORING / "prometheus.yml")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
