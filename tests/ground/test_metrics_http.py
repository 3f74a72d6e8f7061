"""ranklens._metrics_http serves any registry by issue 20's conventions: no ``_created`` series
(counters, histograms, summaries; both exposition formats; ``name[]`` selections) without touching
prometheus-client's process-wide switch, and one ``ranklens_build_info`` (with the store's schema
version, issue 19)."""

from __future__ import annotations

import platform
import urllib.request

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ranklens._metrics_http import BUILD_INFO, build_version, serve_metrics
from ranklens.schema import SCHEMA_VERSION

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def _get(url: str, accept: str | None = None) -> str:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def _names(body: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(body) for s in f.samples}


def _registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Counter("demo_requests", "requests", ["code"], registry=reg).labels("200").inc(3)
    Histogram("demo_latency_seconds", "latency", registry=reg).observe(0.2)
    Summary("demo_size_bytes", "sizes", registry=reg).observe(10)
    Gauge("demo_created", "a gauge that happens to be named *_created", registry=reg).set(7)
    return reg


def test_no_created_series_in_either_format_and_the_rest_intact():
    reg = _registry()
    assert "demo_requests_created" in _names(generate_latest(reg).decode())  # the library adds them
    with serve_metrics(reg) as server:
        text = _get(server.url)
        om = _get(server.url, OPENMETRICS)
    names = _names(text)
    assert not {n for n in names if n.endswith("_created") and n != "demo_created"}
    assert {"demo_requests_total", "demo_latency_seconds_bucket", "demo_latency_seconds_count"} <= names
    assert {"demo_size_bytes_sum", "demo_size_bytes_count", "demo_created"} <= names  # a gauge is kept
    assert "_created{" not in om and "demo_requests_created" not in om and om.rstrip().endswith("# EOF")
    # the registry itself is untouched: the library's own exposition still has them
    assert "demo_requests_created" in _names(generate_latest(reg).decode())


def test_build_info_once_and_only_when_selected():
    reg = _registry()
    with serve_metrics(reg) as server:
        body = _get(server.url)
        only = _get(server.url + "?name[]=demo_requests_total")
        both = _get(server.url + f"?name[]=demo_requests_total&name[]={BUILD_INFO}")
    build = [
        (s.labels, s.value) for f in text_string_to_metric_families(body) for s in f.samples if s.name == BUILD_INFO
    ]
    labels = {"version": build_version(), "python": platform.python_version(), "schema_version": str(SCHEMA_VERSION)}
    assert build == [(labels, 1.0)]
    assert build_version() != "unknown"  # the package is installed (pip install -e .)
    assert _names(only) == {"demo_requests_total"}  # a selection has no _created either
    assert _names(both) == {"demo_requests_total", BUILD_INFO}


def test_a_registry_with_its_own_build_info_is_not_given_a_second():
    reg = CollectorRegistry()
    Gauge(BUILD_INFO, "the embedding app's", ["version"], registry=reg).labels("9.9").set(1)
    with serve_metrics(reg) as server:
        body = _get(server.url)
    assert [s.labels for f in text_string_to_metric_families(body) for s in f.samples] == [{"version": "9.9"}]
