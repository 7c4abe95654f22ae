"""/dashboard: its routes over a fake service (no browser), then the page in a real headless Chromium over a real
uvicorn server and the real EngineService while OpenAI-protocol requests flow: the three panels render, their
charts draw and keep updating, no script error; the screenshot goes to docs/serving/dashboard.png (the README
embeds it). The browser test is skipped, with the reason printed, where chromium / chromedriver are absent."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient
from test_serving_metrics import FakeService, synthetic_records

from dspark.runtime.serving.dashboard import FIELDS, dashboard_routes
from dspark.runtime.serving.metrics import ServingMetrics

SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "serving" / "dashboard.png"
PANELS = ("quality", "load", "resources")
PROMPTS = ["def parse_args(", "The quick brown", "import os\n", "for i in", "class Server:"]


def test_routes_serve_page_assets_and_data():
    service = FakeService()
    metrics = ServingMetrics(service)
    for record in synthetic_records(steps=5):
        service.step(record)
    with TestClient(Starlette(routes=dashboard_routes(metrics))) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        for panel in PANELS:
            assert f'id="panel-{panel}"' in page.text
        for asset in ("dashboard.js", "dashboard.css"):
            assert f"dashboard/static/{asset}" in page.text
            assert client.get(f"/dashboard/static/{asset}").status_code == 200
        assert "http" not in client.get("/dashboard/static/dashboard.js").text.replace("HTTP ", "")  # no CDN
        data = client.get("/dashboard/data").json()
    assert set(data["series"]) == {"t", *FIELDS}
    assert data["totals"]["steps"] == 5 and len(data["series"]["t"]) == 1
    assert data["positions"]["verified"] and data["block_size"] == 4


def browser_paths() -> tuple[str, str]:
    chromium = os.environ.get("DSPARK_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    driver = os.environ.get("DSPARK_CHROMEDRIVER") or shutil.which("chromedriver") or "/usr/bin/chromedriver"
    missing = [p for p in (chromium, driver) if not Path(p).is_file()]
    if missing:
        reason = (f"headless browser test skipped: {', '.join(missing)} not found "
                  "(apt-get install chromium chromium-driver, or set DSPARK_CHROMIUM / DSPARK_CHROMEDRIVER)")
        print(reason)
        pytest.skip(reason)
    return chromium, driver


def open_browser(chromium: str, driver: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1500,900", "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


def flow_requests(url: str, stop: threading.Event, done: list[int], client_id: int) -> None:
    """One OpenAI-protocol client posting completions until told to stop."""
    with httpx.Client(base_url=url, timeout=60) as http:
        i = 0
        while not stop.is_set():
            body = {"model": "tiny", "prompt": PROMPTS[(client_id + i) % len(PROMPTS)], "max_tokens": 40,
                    "temperature": 0.0 if i % 2 else 0.8, "seed": client_id * 1000 + i}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            done[client_id] += 1
            i += 1


def drawn_pixels(browser, chart_id: str) -> int:
    """Pixels of a chart's canvas that differ from its background: the chart drew something."""
    return browser.execute_script(
        """const c = document.querySelector(`#chart-${arguments[0]} canvas`);
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i + 3] !== 0) n++; return n;""", chart_id)


def save_full_page(browser, path: Path, width: int = 1500) -> None:
    """The whole page (down to the footer), not just the viewport: Chrome's device-metrics override."""
    height = browser.execute_script("return Math.ceil(document.querySelector('footer').getBoundingClientRect()"
                                    ".bottom + window.scrollY + 4)")
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                            {"width": width, "height": int(height), "deviceScaleFactor": 1, "mobile": False})
    time.sleep(1.2)  # two polls: the charts redraw at the new size
    path.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(path))


def test_dashboard_renders_and_updates_in_headless_chromium(tmp_path):
    chromium, driver = browser_paths()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    from test_serving_support import running_server, tiny_runtime

    from dspark.runtime.serving.app import ServerConfig, create_app
    from dspark.runtime.serving.service import EngineService

    stop, clients = threading.Event(), 3
    done = [0] * clients
    with tiny_runtime(tmp_path) as rt, EngineService(rt) as service:
        metrics = ServingMetrics(service)
        app = create_app(service, ServerConfig(model_name="tiny", max_tokens_per_request=64), metrics=metrics)
        with running_server(app) as url:
            threads = [threading.Thread(target=flow_requests, args=(url, stop, done, c), daemon=True)
                       for c in range(clients)]
            browser = open_browser(chromium, driver)
            try:
                for thread in threads:
                    thread.start()
                browser.get(f"{url}/dashboard")
                main = browser.find_element(By.ID, "dashboard")
                WebDriverWait(browser, 30).until(lambda b: int(main.get_attribute("data-updates")) >= 2)
                for panel in PANELS:
                    section = browser.find_element(By.ID, f"panel-{panel}")
                    assert section.is_displayed()
                    assert len(section.find_elements(By.TAG_NAME, "canvas")) >= 3
                WebDriverWait(browser, 30).until(lambda b: int(main.get_attribute("data-steps")) > 0)
                throughput = browser.find_element(By.CSS_SELECTOR, "#chart-throughput canvas")
                length = browser.find_element(By.CSS_SELECTOR, "#chart-accepted-length canvas")
                first = [int(main.get_attribute("data-steps")), int(throughput.get_attribute("data-points")),
                         int(length.get_attribute("data-points"))]
                # The charts grow while requests flow: more steps seen, more points drawn on each line chart.
                WebDriverWait(browser, 30).until(
                    lambda b: int(main.get_attribute("data-steps")) > first[0]
                    and int(throughput.get_attribute("data-points")) >= first[1] + 3
                    and int(length.get_attribute("data-points")) > first[2])
                time.sleep(6)  # a few seconds of history for the screenshot
                for chart in ("accepted-length", "positions", "ece", "requests", "throughput", "utilisation", "kv"):
                    assert drawn_pixels(browser, chart) > 200, chart
                assert "steps" in browser.find_element(By.ID, "status").text
                exposition = httpx.get(f"{url}/metrics").text  # the same state, as the app's /metrics serves it
                for name in ("dspark:spec_decode_num_accepted_tokens_total", "dspark:num_requests_running",
                             "dspark:time_to_first_token_seconds_bucket", "dspark:kv_tokens_used"):
                    assert name in exposition, name
                errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
                assert not errors, errors
                save_full_page(browser, SCREENSHOT)
                print(f"dashboard screenshot: {SCREENSHOT}")
            finally:
                stop.set()
                browser.quit()
                for thread in threads:
                    thread.join(timeout=60)
    assert sum(done) > 0
    assert metrics.quality_state()["totals"]["finished"] >= sum(done)
