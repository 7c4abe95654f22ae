"""Routing across engine replicas, without Ray: the policies as pure functions over load snapshots, and the
fleet's /metrics merge (a replica label on every sample)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dspark.runtime.cluster.fleet_metrics import merge_expositions, render, router_families
from dspark.runtime.cluster.routing import (
    NoReplica,
    ReplicaLoad,
    RequestCost,
    Router,
    remaining_work,
    weighted_score,
)

SHORT = RequestCost(prompt_tokens=16, max_new_tokens=16, kv_positions=16 + 16 + 8)
LONG = RequestCost(prompt_tokens=400, max_new_tokens=400, kv_positions=400 + 400 + 8)


def idle(name: str, **changes) -> ReplicaLoad:
    base = ReplicaLoad(name, up=True, slots_total=8, kv_tokens_capacity=8 * 1024, max_queue=8)
    return replace(base, **changes)


def send(loads: list[ReplicaLoad], index: int, cost: RequestCost, router: Router) -> list[ReplicaLoad]:
    """What the fleet's ledger does on a send: one more request, its work, in flight there."""
    load = loads[index]
    loads = list(loads)
    loads[index] = replace(load, in_flight=load.in_flight + 1,
                           in_flight_work=load.in_flight_work + cost.work(router.prefill_weight))
    return loads


def test_round_robin_takes_turns_and_skips_replicas_down_or_full():
    router = Router("round_robin")
    loads = [idle("a"), idle("b"), idle("c")]
    assert [router.choose(loads, SHORT) for _ in range(4)] == [0, 1, 2, 0]
    loads[1] = replace(loads[1], up=False)
    loads[2] = replace(loads[2], queued=8)  # its queue is full
    assert [router.choose(loads, SHORT) for _ in range(3)] == [0, 0, 0]


def test_power_of_two_takes_the_less_busy_of_two_random_replicas():
    loads = [idle("a", in_flight=5), idle("b", in_flight=1), idle("c", in_flight=9)]
    picks = [Router("power_of_two", seed=s).choose(loads, SHORT) for s in range(40)]
    assert set(picks) == {0, 1}  # c (the busiest) can never win a pair
    assert picks.count(1) > picks.count(0)  # b wins both pairs it is in
    assert Router("power_of_two", seed=0).choose([idle("a", up=False), idle("b")], SHORT) == 1


def test_weighted_counts_work_where_the_others_count_requests():
    """One long request on a against three short ones on b: the plain policies see a as less busy, the
    weighted one sees a's work."""
    router = Router("weighted")
    loads = [idle("a"), idle("b")]
    loads = send(loads, 0, LONG, router)
    for _ in range(3):
        loads = send(loads, 1, SHORT, router)
    assert router.choose(loads, SHORT) == 1
    assert Router("power_of_two", seed=1).choose(loads, SHORT) == 0
    assert weighted_score(loads[0], SHORT) > weighted_score(loads[1], SHORT)


def test_weighted_keeps_a_skewed_stream_balanced_where_round_robin_does_not():
    """Long requests every other one: round-robin sends them all to one replica; weighted spreads the work."""
    stream = [LONG, SHORT] * 20
    work = {}
    for policy in ("round_robin", "weighted"):
        router, loads = Router(policy), [idle("a", max_queue=100), idle("b", max_queue=100)]
        for cost in stream:
            loads = send(loads, router.choose(loads, cost), cost, router)
        work[policy] = [load.in_flight_work for load in loads]
    assert max(work["round_robin"]) / min(work["round_robin"]) > 10
    assert max(work["weighted"]) / min(work["weighted"]) < 1.2


def test_weighted_uses_the_replicas_report_when_it_knows_more_than_the_ledger():
    """Work other routers sent shows only in the replica's report."""
    router = Router("weighted")
    loads = [idle("a", reported_work=5000.0), idle("b", in_flight=2, in_flight_work=300.0)]
    assert router.choose(loads, SHORT) == 1


def test_weighted_prefers_a_replica_where_the_request_fits_now():
    """Same work ahead, but on a the request's KV positions are not free: it would wait there."""
    router = Router("weighted")
    a = idle("a", running=2, kv_tokens_reserved=8 * 1024 - 100, reported_work=200.0)
    b = idle("b", running=2, kv_tokens_reserved=1000, reported_work=200.0)
    assert not a.fits_now(LONG) and b.fits_now(LONG)
    assert router.choose([a, b], LONG) == 1
    assert weighted_score(a, LONG) == pytest.approx(weighted_score(b, LONG) + 200.0)
    # a tie goes to the larger KV headroom
    assert router.choose([idle("a", kv_tokens_reserved=900), idle("b", kv_tokens_reserved=100)], SHORT) == 1


@pytest.mark.parametrize("policy", ["weighted", "round_robin", "power_of_two"])
def test_no_replica_that_can_take_it_is_a_clear_refusal(policy):
    router = Router(policy)
    with pytest.raises(NoReplica, match="no engine replica is up"):
        router.choose([idle("a", up=False), idle("b", up=False)], SHORT)
    with pytest.raises(NoReplica, match="queue is full"):
        router.choose([idle("a", queued=8), idle("b", in_flight=16)], SHORT)  # b: 8 running + 8 waiting by ledger
    with pytest.raises(NoReplica, match="no engine replica is up"):
        router.choose([idle("a"), idle("b", up=False)], SHORT, exclude=frozenset({0}))
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router("random")


def test_remaining_work_drops_the_prefill_at_the_first_token():
    assert remaining_work(100, 50, 0, 0.25) == 75.0
    assert remaining_work(100, 50, 10, 0.25) == 40.0
    assert remaining_work(100, 50, 60, 0.25) == 0.0
    assert LONG.work(0.25) == 500.0


def _exposition(steps: int, running: int) -> bytes:
    registry = CollectorRegistry()
    Counter("dspark:engine_steps", "Steps.", registry=registry).inc(steps)
    Gauge("dspark:num_requests_running", "Running.", registry=registry).set(running)
    Histogram("dspark:e2e_request_latency_seconds", "E2E.", buckets=(0.1, 1.0), registry=registry).observe(0.5)
    return generate_latest(registry)


def test_metrics_merge_labels_every_sample_with_its_replica():
    text = render(merge_expositions({"engine-0": _exposition(3, 1), "engine-1": _exposition(5, 2)})).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    steps = {s.labels["replica"]: s.value for s in families["dspark:engine_steps"].samples if s.name.endswith("_total")}
    assert steps == {"engine-0": 3.0, "engine-1": 5.0}
    running = {s.labels["replica"]: s.value for s in families["dspark:num_requests_running"].samples}
    assert running == {"engine-0": 1.0, "engine-1": 2.0}
    buckets = [s for s in families["dspark:e2e_request_latency_seconds"].samples if s.name.endswith("_bucket")]
    assert {(s.labels["replica"], s.labels["le"]) for s in buckets} == {
        (r, le) for r in ("engine-0", "engine-1") for le in ("0.1", "1.0", "+Inf")}
    assert text.count("# TYPE dspark:num_requests_running ") == 1  # one family, not one per replica


def test_router_families_name_each_replica():
    loads = [idle("engine-0", in_flight=2, in_flight_work=40.0), idle("engine-1", up=False)]
    text = render(router_families(loads, {"engine-0": 7}, rejected=3, policy="weighted")).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {s.labels["replica"]: s.value for s in families["dspark:replica_up"].samples} == {
        "engine-0": 1.0, "engine-1": 0.0}
    assert [s.value for s in families["dspark:router_requests_rejected"].samples if s.name.endswith("_total")] == [3.0]


def test_serve_replicas_without_ray_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    import sys

    from click.testing import CliRunner

    from dspark.tools.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # as if the ray extra were not installed
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    result = CliRunner().invoke(main, ["serve", "--engine", str(tmp_path), "--replicas", "2"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("dspark serve: error: "), result.output
    assert "pip install 'dspark[ray]'" in lines[0] and "Traceback" not in result.output
