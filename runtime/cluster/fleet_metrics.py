"""/metrics for the fleet: every replica's `dspark:` exposition with a `replica` label on each sample, merged
family by family (one HELP/TYPE per name, so Prometheus and Grafana read the fleet as one target), plus the
router's own gauges and counters per replica."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from .routing import ReplicaLoad

LABEL = "replica"


def merge_expositions(texts: Mapping[str, bytes | str]) -> list[Metric]:
    """The families of each replica's exposition (replica name -> text), each sample labelled with its replica;
    a family present in several replicas becomes one family holding all their samples."""
    merged: dict[str, Metric] = {}
    for replica, text in texts.items():
        text = text.decode() if isinstance(text, bytes) else text
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                into.add_sample(sample.name, {LABEL: replica, **sample.labels}, sample.value, sample.timestamp)
    return list(merged.values())


def router_families(loads: Iterable[ReplicaLoad], routed: Mapping[str, int], rejected: int,
                    policy: str) -> list[Metric]:
    """The ingress's view: replicas up, requests and expected work in flight, requests routed and refused."""
    loads = list(loads)
    up = GaugeMetricFamily("dspark:replica_up", "1 when the engine replica answers the router's load polls.",
                           labels=[LABEL])
    in_flight = GaugeMetricFamily("dspark:router_in_flight_requests", "Requests the router has sent to the "
                                  "replica and not seen end.", labels=[LABEL])
    work = GaugeMetricFamily("dspark:router_in_flight_work", "Expected work (decode-token units) of those "
                             "requests still to do.", labels=[LABEL])
    budget = GaugeMetricFamily("dspark:replica_verification_budget", "Tokens the replica's target verified per "
                               "step, recent mean (as last reported).", labels=[LABEL])
    sent = CounterMetricFamily("dspark:router_requests_routed", f"Requests routed to the replica (policy "
                               f"{policy}, retries included).", labels=[LABEL])
    for load in loads:
        up.add_metric([load.name], float(load.up))
        in_flight.add_metric([load.name], load.in_flight)
        work.add_metric([load.name], load.in_flight_work)
        budget.add_metric([load.name], load.verification_budget)
        sent.add_metric([load.name], routed.get(load.name, 0))
    refused = CounterMetricFamily("dspark:router_requests_rejected", "Requests refused with 429: no replica up "
                                  "with room in its queue.", value=rejected)
    return [up, in_flight, work, budget, sent, refused]


def render(families: Iterable[Metric]) -> bytes:
    """The Prometheus text exposition of these families."""
    return generate_latest(_Families(list(families)))


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
