"""`dspark serve --replicas N`: start (or join) Ray, run the application of deploy.py on Ray Serve's HTTP proxy,
and wait until interrupted; then take the application down (and the local Ray with it)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from ..serving.app import ServerConfig
from .replica import EngineSpec

log = logging.getLogger("dspark.cluster")
APP_NAME = "dspark"


def import_serve() -> object:
    """ray.serve, or ImportError with the one line that says how to get it."""
    try:
        from ray import serve
    except ImportError:
        raise ImportError("--replicas runs on Ray Serve, which is not installed: pip install 'dspark[ray]'") from None
    return serve


def serve_replicas(spec: EngineSpec, *, replicas: int, policy: str, config: ServerConfig, host: str, port: int,
                   max_queue: int, cpus_per_replica: float, address: str | None = None,
                   announce: Callable[[str], None] = print) -> None:
    """Run the fleet until Ctrl-C. `address`: an existing Ray cluster ("auto", "ray://..."); None starts a
    local one sized to this machine."""
    serve = import_serve()
    import ray

    from .deploy import build_app

    local = address is None
    if local:  # Ray starts its workers at nice 15; on a machine shared with other work the engines would starve
        os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(spec, replicas=replicas, policy=policy, config=config, max_queue=max_queue,
                            cpus_per_replica=cpus_per_replica), name=APP_NAME, route_prefix="/")
        announce(f"{replicas} engine replicas behind http://{host}:{port} (routing: {policy})")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if local:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
        ray.shutdown()
