"""dspark.runtime.cluster: N dspark engine replicas on Ray Serve behind one OpenAI-compatible endpoint.

    routing.py          which replica serves a request (weighted by expected cost, round-robin, power of two)
    replica.py          one engine replica: a Runtime and its EngineService loop
    feed.py             the replica's one stream to an ingress: every step's updates of all its requests
    fleet.py            the ingress's view of the replicas, shaped like an EngineService for runtime/serving's app
    remote_request.py   a request as the ingress holds it: sent, re-sent, moved off a dead replica
    snapshot_keeper.py  request snapshots in a detached actor that outlives a replica (one table per replica)
    migration.py        a dead replica's request resumed elsewhere: its stream spliced onto what the client has
    fleet_metrics.py    /metrics across the replicas (a replica label on every sample)
    deploy.py           the Ray Serve application (`dspark serve --replicas N`, `serve run ...:app_builder`)

Only deploy.py imports Ray (the `ray` extra: pip install 'dspark[ray]').
"""
