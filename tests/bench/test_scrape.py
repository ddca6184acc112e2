"""Reading replica counters from Prometheus text."""

from kvgate.bench.agentic.scrape import Counters, parse_prometheus, sum_counters

TEXT = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
vllm:kv_cache_usage_perc{engine="0"} 0.5
kvgate_sim:preemptions_total 3
vllm:num_preemptions_total{engine="0"} 3
kvgate_sim:num_free_blocks{engine="0"} 17
kvgate_sim:recomputed_tokens_total{engine="0"} 120
garbage line without value
vllm:num_requests_running{label="a b"} NaN
"""


def test_parse_sums_label_sets_and_skips_noise():
    totals = parse_prometheus(TEXT)
    assert totals["vllm:prefix_cache_queries_total"] == 1500.0
    assert totals["vllm:prefix_cache_hits_total"] == 600.0
    assert "vllm:prefix_cache_queries_created" not in totals
    assert "vllm:num_requests_running" not in totals


def test_counters_delta_and_sum():
    after = Counters.from_metrics(parse_prometheus(TEXT))
    assert after.hit_rate == 0.4
    assert after.sim == {"kvgate_sim:preemptions_total": 3.0, "kvgate_sim:recomputed_tokens_total": 120.0}
    assert after.preemptions == 3.0
    before = Counters(queries=500.0, hits=100.0, preemptions=1.0, sim={"kvgate_sim:preemptions_total": 1.0})
    delta = after.minus(before)
    assert (delta.queries, delta.hits, delta.preemptions) == (1000.0, 500.0, 2.0)
    assert delta.sim == {"kvgate_sim:preemptions_total": 2.0, "kvgate_sim:recomputed_tokens_total": 120.0}
    total = sum_counters([delta, before])
    assert (total.queries, total.hits, total.sim["kvgate_sim:preemptions_total"]) == (1500.0, 600.0, 3.0)
    assert Counters().hit_rate == 0.0


def test_the_servers_cpu_seconds_when_every_replica_exports_them():
    cpu = "process_cpu_seconds_total 2.5\n"
    before = Counters.from_metrics(parse_prometheus(cpu))
    after = Counters.from_metrics(parse_prometheus("process_cpu_seconds_total 4.0\n"))
    assert before.cpu_seconds == 2.5 and after.minus(before).cpu_seconds == 1.5
    assert sum_counters([before, after]).cpu_seconds == 6.5
    without = Counters.from_metrics(parse_prometheus(TEXT))
    assert without.cpu_seconds is None  # a replica that does not export it: unknown, not 0
    assert sum_counters([before, without]).cpu_seconds is None
    assert after.minus(without).cpu_seconds is None


def test_probe_totals_by_kind_summed_over_replicas():
    import pytest

    from kvgate.bench.agentic.scrape import probe_totals

    text = "\n".join(
        [
            "# HELP kvgate_probe_seconds Latency of replica probes.",
            'kvgate_probe_seconds_bucket{le="0.01",probe="kv",replica="r0"} 3.0',
            'kvgate_probe_seconds_count{probe="kv",replica="r0"} 4.0',
            'kvgate_probe_seconds_sum{probe="kv",replica="r0"} 0.02',
            'kvgate_probe_seconds_count{probe="kv",replica="r1"} 6.0',
            'kvgate_probe_seconds_sum{probe="kv",replica="r1"} 0.03',
            'kvgate_probe_seconds_count{probe="prefix",replica="r0"} 2.0',
            'kvgate_probe_seconds_sum{probe="prefix",replica="r0"} 0.5',
            'kvgate_probe_seconds_created{probe="prefix",replica="r0"} 1.7e9',
        ]
    )
    totals = probe_totals(text)
    assert totals["kv"] == {"count": 10.0, "seconds": pytest.approx(0.05)}
    assert totals["prefix"] == {"count": 2.0, "seconds": 0.5}
