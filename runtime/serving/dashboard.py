"""The live dashboard: `/dashboard` (a static page, static/, drawn by its own canvas code: no build step, no
CDN, works offline) and `/dashboard/data`, the JSON it polls every ~500 ms.

The time series is sampled when the data is read, never on the engine's loop thread: each point is the
difference of ServingMetrics' running totals since the previous point (rates, interval means) plus the
current load and resource readings. Reads closer together than `min_interval` share a point, so several open
pages do not thin the series; an unwatched server does no sampling work.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from .metrics import ServingMetrics

STATIC = Path(__file__).with_name("static")
FIELDS = (
    # quality
    "accepted_length", "acceptance_rate", "verified_fraction", "ece", "ece_recent",
    # load
    "running", "waiting", "steps_per_s", "tokens_per_s", "verified_per_step", "budget_per_step", "ttft_ms",
    "itl_ms",
    # resources
    "cpu_percent", "process_cpu_percent", "gpu_percent", "rss_mb", "gpu_memory_mb", "host_memory_percent",
    "kv_used", "kv_reserved", "slots_used",
)


class DashboardSeries:
    """The last `history` points of the three dimensions, for one ServingMetrics."""

    def __init__(self, metrics: ServingMetrics, *, history: int = 240, min_interval: float = 0.2) -> None:
        self.metrics, self.min_interval = metrics, min_interval
        self.start = time.monotonic()
        self.points: deque[dict[str, float | None]] = deque(maxlen=history)
        self._last_time = self.start
        self._last_totals = metrics.quality_state()["totals"]
        self._lock = threading.Lock()

    def sample(self, now: float | None = None) -> bool:
        """Append a point covering the time since the previous one; False when that was under min_interval."""
        now = time.monotonic() if now is None else now
        with self._lock:
            dt = now - self._last_time
            if self.points and dt < self.min_interval:
                return False
            m = self.metrics
            state, snap, res, ece = m.quality_state(), m.service.snapshot(), m.resources(), m.ece.values()
            t = state["totals"]
            d = {k: t[k] - self._last_totals.get(k, 0.0) for k in t}
            self._last_time, self._last_totals = now, t
            capacity = max(snap.kv_tokens_capacity, 1)
            point: dict[str, float | None] = {
                "t": now - self.start,
                "accepted_length": _ratio(d["committed"], d["rows"]),
                "acceptance_rate": _ratio(d["accepted_drafts"], d["verified_drafts"]),
                "verified_fraction": _ratio(d["verified_drafts"], d["proposed"]),
                "ece": ece["ece"], "ece_recent": ece["recent"],
                "running": snap.running, "waiting": snap.queued,
                "steps_per_s": _ratio(d["steps"], dt) or 0.0, "tokens_per_s": _ratio(d["committed"], dt) or 0.0,
                "verified_per_step": _ratio(d["verified_tokens"], d["steps"]),
                "budget_per_step": _ratio(d["budget"], d["steps"]),
                "ttft_ms": _scaled(_ratio(d["ttft_sum"], d["ttft_n"]), 1e3),
                "itl_ms": _scaled(_ratio(d["itl_sum"], d["itl_n"]), 1e3),
                "cpu_percent": res["cpu_percent"], "process_cpu_percent": res["process_cpu_percent"],
                "gpu_percent": res["gpu_percent"],
                "rss_mb": _scaled(res["rss_bytes"], 2.0**-20), "gpu_memory_mb": _scaled(res["gpu_memory_used_bytes"],
                                                                                         2.0**-20),
                "host_memory_percent": res["host_memory_percent"],
                "kv_used": snap.kv_tokens_used / capacity, "kv_reserved": snap.kv_tokens_reserved / capacity,
                "slots_used": snap.running / max(snap.slots_total, 1),
            }
            self.points.append(point)
            return True

    def data(self) -> dict[str, Any]:
        """Column-wise series (one list per field, None where an interval had nothing to measure), the latest
        point, the running totals and the per-position counts."""
        m = self.metrics
        with self._lock:
            points = list(self.points)
        state, ece = m.quality_state(), m.ece.values()
        snap = m.service.snapshot()
        return {
            "now": time.monotonic() - self.start,
            "block_size": m.block_size,
            "calibrated": m.temperatures is not None,
            "series": {k: [p[k] for p in points] for k in ("t", *FIELDS)},
            "latest": points[-1] if points else {},
            "totals": {k: state["totals"][k] for k in ("steps", "rows", "committed", "drafts", "proposed",
                                                       "verified_drafts", "accepted_drafts", "finished")},
            "positions": {"drafts": state["totals"]["drafts"], "verified": state["verified"],
                          "accepted": state["accepted"], "ece": ece["per_position"]},
            "ece_samples": ece["samples"],
            "load": {"slots_total": snap.slots_total, "kv_tokens_capacity": snap.kv_tokens_capacity,
                     "submitted": snap.submitted, "finished": snap.finished, "max_queue": snap.max_queue},
        }


def dashboard_routes(metrics: ServingMetrics, *, history: int = 240, min_interval: float = 0.2) -> list[BaseRoute]:
    """GET /dashboard (the page), /dashboard/data (its JSON), /dashboard/static/* (its script and style)."""
    series = DashboardSeries(metrics, history=history, min_interval=min_interval)

    async def page(request: Request) -> Response:
        return FileResponse(STATIC / "dashboard.html", media_type="text/html", headers={"Cache-Control": "no-cache"})

    async def data(request: Request) -> Response:
        series.sample()
        return JSONResponse(series.data(), headers={"Cache-Control": "no-store"})

    return [
        Route("/dashboard", page, methods=["GET"]),
        Route("/dashboard/data", data, methods=["GET"]),
        Mount("/dashboard/static", app=StaticFiles(directory=STATIC), name="dashboard-static"),
    ]


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor
