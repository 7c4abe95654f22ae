"""The Ray Serve application: N engine deployments (one replica each, each one EngineService loop) behind
an ingress deployment that serves the OpenAI app of runtime/serving over the fleet (fleet.py) and routes
each request itself (routing.py).

Why the ingress routes rather than a Ray Serve `RequestRouter` on one N-replica deployment: that API is alpha
in Ray 2.60 ("may change before becoming stable"), its replica stats reach the router through the controller
every `request_routing_stats_period_s` (10 s by default), and when every replica is full it retries with
backoff instead of refusing: a hang, where the issue wants 429. Routing in the ingress keeps the policy a pure
function over a ledger updated at every send, token and end, refuses with 429 when no replica can hold a
request, and retries a request no token of which was delivered when its replica dies. The price: each engine
is its own deployment (Ray Serve still restarts a dead one), and with several ingress replicas each routes
on its own ledger plus the replicas' reports.

With `recovery` (the default), every replica records its requests' snapshots into one detached named actor,
the snapshot keeper (snapshot_keeper.py; created by whichever process asks first, `get_if_exists`), and the
ingress moves the requests of a replica that dies to a live one from those snapshots (remote_request.py).

    serve run dspark.runtime.cluster.deploy:app_builder engine=/path/to/engine replicas=2 routing=weighted
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ..api import RuntimeOptions
from ..prefix_scheduler import SchedulerConfig
from ..recovery.snapshot import SnapshotStore
from ..serving.app import ServerConfig, create_app
from . import fleet_metrics
from .fleet import POLL_INTERVAL, Fleet
from .replica import EngineReplica, EngineSpec
from .routing import POLICIES, Router
from .snapshot_keeper import KEEPER_NAME, KEEPER_NAMESPACE, KeeperStore, SnapshotKeeper

METRICS_TIMEOUT = 5.0  # a replica that does not answer a scrape within this is left out of it


def keeper_handle() -> Any:
    """The snapshot keeper's actor handle: the detached named actor, started here if it does not exist yet
    (no CPU of its own; it outlives the replicas, the ingress and the application: `ray.kill` ends it)."""
    import ray

    return ray.remote(SnapshotKeeper).options(name=KEEPER_NAME, namespace=KEEPER_NAMESPACE, lifetime="detached",
                                              get_if_exists=True, num_cpus=0).remote()


def keeper_store(table: str) -> SnapshotStore:
    """A replica's snapshot store: its table in the keeper (`EngineReplica(store=keeper_store)`)."""
    import ray

    return KeeperStore(keeper_handle(), table, get=ray.get)


@serve.ingress()
class Ingress:
    """The HTTP entry: the OpenAI app over a Fleet of the engine deployments' handles."""

    async def __init__(self, engines: list[Any], names: list[str], config: ServerConfig, policy: str,
                       seed: int = 0, poll_interval: float = POLL_INTERVAL, recovery: bool = True) -> None:
        self.config, self.policy = config, policy
        self.fleet = await Fleet.start(list(zip(names, engines, strict=True)), Router(policy, seed=seed),
                                       poll_interval, keeper=keeper_handle() if recovery else None)

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.fleet, self.config, observability=self._routes())

    def __del__(self) -> None:
        self.fleet.close()

    def set_policy(self, policy: str, seed: int = 0) -> str:
        """Switch the routing policy on the running fleet (a handle call, not HTTP: tools/cluster_bench.py
        compares policies on the same replicas); the ledger stays. Returns the policy now in force."""
        self.fleet.router = Router(policy, seed=seed)
        self.policy = policy
        return policy

    def _routes(self) -> list[BaseRoute]:
        fleet = self.fleet

        async def metrics(request: Request) -> Response:
            up = [r for r in fleet.replicas if r.up]
            texts = await _gather_texts({r.name: r.handle.metrics_text.remote() for r in up})
            families = fleet_metrics.merge_expositions(texts)
            families += fleet_metrics.router_families(fleet.loads(), {r.name: r.routed for r in fleet.replicas},
                                                      fleet.rejected, self.policy)
            return Response(fleet_metrics.render(families), media_type="text/plain; version=0.0.4; charset=utf-8")

        async def replicas(request: Request) -> Response:
            return JSONResponse({"policy": self.policy, "migrated": fleet.migrated, "diverged": fleet.diverged,
                                 "replicas": [
                {"name": r.name, "up": r.up, "why_down": r.why_down, "host": r.info.host, "pid": r.info.pid,
                 "in_flight": r.in_flight, "in_flight_work": r.in_flight_work, "routed": r.routed,
                 "verification_budget": r.report.verification_budget if r.report else None,
                 "reported_work": r.report.remaining_work if r.report else None,
                 "load": _plain(r.report.snapshot.__dict__) if r.report else None} for r in fleet.replicas]})

        return [Route("/metrics", metrics, methods=["GET"]), Route("/replicas", replicas, methods=["GET"])]


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """JSON-ready numbers (the engine's counters may be numpy scalars)."""
    return {name: value.item() if hasattr(value, "item") else value for name, value in values.items()}


async def _gather_texts(pending: dict[str, Any]) -> dict[str, bytes]:
    async def one(response: Any) -> bytes | None:
        try:
            return await asyncio.wait_for(response, METRICS_TIMEOUT)
        except Exception:  # a replica dying or restarting: its samples are missing from this scrape
            return None

    texts = await asyncio.gather(*(one(r) for r in pending.values()))
    return {name: text for name, text in zip(pending, texts, strict=True) if text is not None}


def build_app(spec: EngineSpec, *, replicas: int = 2, policy: str = "weighted", config: ServerConfig | None = None,
              max_queue: int = 1024, cpus_per_replica: float = 1.0, seed: int = 0,
              poll_interval: float = POLL_INTERVAL, recovery: bool = True) -> Application:
    """The application: `replicas` engine deployments named dspark-engine-0.. and the ingress (route /).
    `recovery`: snapshots in the keeper, and a dead replica's requests moved to a live one."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
    config = config or ServerConfig()
    in_flight = spec.options.max_requests + max_queue + 64  # Ray Serve must never queue in front of the service
    engine = serve.deployment(EngineReplica)
    names = [f"dspark-engine-{i}" for i in range(replicas)]
    engines = [engine.options(name=name, num_replicas=1, max_ongoing_requests=in_flight, max_queued_requests=-1,
                              ray_actor_options={"num_cpus": cpus_per_replica}, health_check_period_s=2,
                              health_check_timeout_s=30, graceful_shutdown_timeout_s=5,
                              logging_config={"enable_access_log": False})
               .bind(spec, name, max_queue, config.max_tokens_per_request, keeper_store if recovery else None)
               for name in names]
    ingress = serve.deployment(Ingress).options(
        name="dspark-ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=replicas * in_flight + 256, logging_config={"enable_access_log": False})
    return ingress.bind(engines, names, config, policy, seed, poll_interval, recovery)


def app_builder(args: dict[str, str]) -> Application:
    """`serve run dspark.runtime.cluster.deploy:app_builder engine=DIR [replicas=2] [routing=weighted]
    [model_name=NAME] [max_requests=64] [max_seq_len=1024] [max_queue=1024] [scheduler=dspark]
    [max_tokens_per_request=512] [cpus_per_replica=1] [threads=N] [api_key=KEY]`
    (threads: ORT's intra-op count per replica; the engine's own by default)."""
    known = {"engine", "replicas", "routing", "model_name", "max_requests", "max_seq_len", "max_queue", "scheduler",
             "max_tokens_per_request", "cpus_per_replica", "threads", "api_key"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if "engine" not in args:
        raise ValueError("engine=DIR is required (an engine or dspark-export directory on every node)")
    options = RuntimeOptions(scheduler=SchedulerConfig(args.get("scheduler", "dspark")),
                             max_requests=int(args.get("max_requests", 64)),
                             max_seq_len=int(args.get("max_seq_len", 1024)))
    threads = int(args["threads"]) if "threads" in args else None
    spec = EngineSpec(engine_dir=args["engine"], options=options, threads=threads)
    config = ServerConfig(model_name=args.get("model_name") or Path(args["engine"]).resolve().name,
                          api_key=args.get("api_key"),
                          max_tokens_per_request=int(args.get("max_tokens_per_request", 512)))
    return build_app(spec, replicas=int(args.get("replicas", 2)), policy=args.get("routing", "weighted"),
                     config=config, max_queue=int(args.get("max_queue", 1024)),
                     cpus_per_replica=float(args.get("cpus_per_replica", 1)))
