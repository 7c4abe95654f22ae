"""Shared pieces of the journal tests (no tests here): a journaled server on the tiny pair as a real
subprocess (`python tests/test_journal_support.py ROOT JOURNAL PORT`), and an SSE reader that keeps the
event ids."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

TESTS = Path(__file__).resolve().parent
STEP_DELAY = 0.1  # seconds added to each engine step in the server: a slower model
HOLD = "DSPARK_TEST_HOLD"  # "R:T": the server stops stepping once R requests run with >= T tokens each


def start_server(root: Path, journal: Path, port: int, log: Path, hold: str | None = None) -> subprocess.Popen:
    """`hold` ("R:T"): the engine stops before its next step once R requests run with T tokens or more each, so
    a test that kills it then knows every stream is mid-way, however slowly the test itself reads."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    if hold is not None:
        env[HOLD] = hold
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, str(Path(__file__)), str(root), str(journal), str(port)],
                                stdout=out, stderr=out, env=env)


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server did not come up")


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(30)


def events(response: httpx.Response):
    """(id or None, data) per SSE event of a streaming response."""
    event_id, data = None, []
    for line in response.iter_lines():
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data.append(line[6:])
        elif not line and data:
            yield event_id, "\n".join(data)
            event_id, data = None, []


def token_ids(data: str) -> list[int]:
    if data == "[DONE]":
        return []
    return (json.loads(data).get("dspark") or {}).get("token_ids", [])


def main(root: str, journal: str, port: str) -> None:
    from test_serving_support import tiny_runtime

    from dspark.runtime.batch_loop import BatchEngine
    from dspark.runtime.serving.app import ServerConfig
    from dspark.tools.serve_engine import serve_runtime

    step = BatchEngine.step
    hold = [int(v) for v in os.environ[HOLD].split(":")] if HOLD in os.environ else None

    def slow_step(self):  # a slower model, held mid-stream when asked: the test kills the server then
        running = [len(a.result.tokens) for a in self.active]
        if hold is not None and len(running) >= hold[0] and min(running) >= hold[1]:
            while True:  # the last step's tokens went out; nothing more until the SIGKILL
                time.sleep(1)
        record = step(self)
        time.sleep(STEP_DELAY)
        return record

    BatchEngine.step = slow_step
    runtime = tiny_runtime(Path(root), scheduler="fixed")
    serve_runtime(runtime, ServerConfig(model_name="tiny", max_tokens_per_request=200), host="127.0.0.1",
                  port=int(port), journal_dir=journal, log_level="warning", source="the tiny pair")


if __name__ == "__main__":
    main(*sys.argv[1:])
