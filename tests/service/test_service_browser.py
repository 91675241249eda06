"""The dashboard in a real headless Chromium: it shows the job's layers and follows new steps
over server-sent events (one stream, no polling of the metric routes) until the job ends, and
draws every layer's bits over the steps (a heat map refetched only when the stream says the
metrics changed). Steps are driven by pushing records into the job's real sink actor."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from playwright.sync_api import Page
from service_support import (
    API_TOKEN,
    LAYERS,
    LiveServer,
    chromium_page,
    make_settings,
    ray_cluster,
    step_records,
)

from service.ray_head import LocalRayHead
from service.storage import open_storage
from tail_ray.metrics.sink import get_or_create_sink

pytestmark = [pytest.mark.ray, pytest.mark.browser]


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayHead]:
    with ray_cluster(tmp_path_factory.mktemp("ray"), num_cpus=1) as h:
        yield h


@pytest.fixture(scope="module")
def page() -> Iterator[Page]:
    with chromium_page() as p:
        yield p


def _push(job_id: str, steps: range, ratio_scale: float) -> None:
    sink = get_or_create_sink(job_id)
    for step in steps:
        ray.get(sink.push.remote(step_records(job_id, step, ratio_scale=ratio_scale)))


def _push_lowrank(job_id: str) -> None:
    """Steps 6 and 7, where the last layer goes as rank-4 factors (bits 8, the factors'): on both
    ranks at step 6, on rank 0 alone at step 7."""
    sink = get_or_create_sink(job_id)
    for step in (6, 7):
        records = step_records(job_id, step)
        for rec in records:
            if rec["type"] == "layer" and rec["layer"] == LAYERS[-1] and (step == 6 or rec["rank"] == 0):
                rec.update(bits=8, code="lowrank-r4")
        ray.get(sink.push.remote(records))


def _layer_ratios(page: Page) -> list[float]:
    return page.evaluate("() => window.tailDashboard.charts.layer.data.datasets[0].data")


def _bits_pixel(page: Page, row: int, column: int) -> list[int]:
    """The RGB the heat map painted at a cell's centre (device pixels; the pixel below and right
    of it, floor not round, so that it lies inside the 2 px dot of a mixed window)."""
    return page.evaluate(
        """([row, column]) => {
            const chart = window.tailDashboard.bitsChart;
            const { x, y } = chart.cellCentre(row, column);
            const dpr = window.devicePixelRatio || 1;
            const ctx = chart.canvas.getContext("2d");
            const px = ctx.getImageData(Math.floor(x * dpr), Math.floor(y * dpr), 1, 1);
            return Array.from(px.data.slice(0, 3));
        }""",
        [row, column],
    )


def _check_bits_heat_map(page: Page, steps: int) -> None:
    """The heat map shows every layer, one column per step, the bits the records said
    (``step_records``: 2 + (layer + step) % 6 on both ranks), in the colour of those bits."""
    page.wait_for_function(
        "n => window.tailDashboard.bitsChart.model?.columns === n", arg=steps, timeout=30_000
    )
    model = page.evaluate("() => window.tailDashboard.bitsChart.model")
    assert model["layers"] == list(LAYERS) and model["width"] == 1
    drawn = [[cell["bits"] for cell in row] for row in model["cells"]]
    assert drawn == [[2 + (i + s) % 6 for s in range(steps)] for i in range(len(LAYERS))]
    assert all(cell["min"] == cell["max"] for row in model["cells"] for cell in row)  # ranks agreed
    # Different bits, different colours; the same bits (2: layer 0 at step 0, layer 1 at 5), the same.
    two, three = _bits_pixel(page, 0, 0), _bits_pixel(page, 0, 1)
    assert two != three, (two, three)
    if steps > 5:
        assert _bits_pixel(page, 1, 5) == two
    assert page.locator("#bits-status").inner_text().startswith(f"steps 0\u2013{steps - 1}")


def test_dashboard_shows_layers_and_follows_the_steps(head: LocalRayHead, tmp_path: Path, page: Page) -> None:
    db = tmp_path / "db.sqlite"
    job_id = "browser-job"
    spec = {"method": "tail", "model": "digits_cnn", "dataset": "digits"}
    with open_storage(db) as store:
        store.insert_job(
            job_id=job_id,
            name="live-digits",
            source="api",
            status="RUNNING",
            entrypoint="python -m jobs.train",
            spec=spec,
        )
    _push(job_id, range(3), ratio_scale=1.0)
    with LiveServer(make_settings(db, head)) as server:
        requests: list[str] = []
        page.on("request", lambda request: requests.append(request.url))
        page.goto(f"{server.url}/?poll_ms=300&bits_ms=300#job={job_id}")
        page.wait_for_function(
            "n => window.tailDashboard.charts.layer.data.labels.length === n", arg=len(LAYERS), timeout=30_000
        )
        assert page.evaluate("() => window.tailDashboard.charts.layer.data.labels") == list(LAYERS)
        page.wait_for_function(
            "() => document.getElementById('last-step').textContent === '2'", timeout=30_000
        )
        assert page.locator("#jobs-table tbody tr").first.inner_text().startswith("live-digits")
        assert page.locator("#layer-table tbody tr").count() == len(LAYERS)
        # The last column says how each layer went (the records pushed above say "tail").
        assert page.locator("#layer-table tbody tr td:last-child").all_inner_texts() == ["tail"] * len(LAYERS)
        before = _layer_ratios(page)
        assert all(r > 1 for r in before)
        assert page.evaluate("() => window.tailDashboard.charts.traffic.data.labels.length") == 3
        _check_bits_heat_map(page, steps=3)

        _push(job_id, range(3, 6), ratio_scale=3.0)  # training moves on; compression tightens
        page.wait_for_function(
            "() => document.getElementById('last-step').textContent === '5'", timeout=30_000
        )
        page.wait_for_function(
            "() => window.tailDashboard.charts.traffic.data.labels.length === 6", timeout=30_000
        )
        after = _layer_ratios(page)
        assert len(after) == len(LAYERS)
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
        steps_in_table = page.locator("#layer-table tbody tr td:nth-child(2)").all_inner_texts()
        assert steps_in_table == ["5"] * len(LAYERS)
        assert page.locator("#world-size").inner_text() == "2"
        assert page.locator("#ratio").inner_text().endswith("\u00d7")  # the multiplication sign
        _check_bits_heat_map(page, steps=6)

        # The last layer goes low-rank: its cells take the low-rank colour, not 8 bits' yellow,
        # and step 7 (one rank of two low-rank) carries the dot of a mixed window.
        _push_lowrank(job_id)
        page.wait_for_function("() => window.tailDashboard.bitsChart.model?.columns === 8", timeout=30_000)
        model = page.evaluate("() => window.tailDashboard.bitsChart.model")
        low = model["cells"][len(LAYERS) - 1]
        assert [c["lowrank"] for c in low] == [0] * 6 + [1, 0.5]
        assert all(c["lowrank"] == 0 for row in model["cells"][:-1] for c in row)
        lowrank_red, mixed_dot = [214, 39, 40], [255, 255, 255]
        assert _bits_pixel(page, len(LAYERS) - 1, 6) == lowrank_red
        assert _bits_pixel(page, len(LAYERS) - 1, 7) == mixed_dot
        assert _bits_pixel(page, 0, 6) not in (lowrank_red, mixed_dot)  # quantized at 2 + 6 % 6 bits
        assert _bits_pixel(page, 0, 6) == _bits_pixel(page, 0, 0)
        status = page.locator("#bits-status").inner_text()
        assert "1 cell(s) where bits or kind changed" in status and "2 low-rank cell(s)" in status, status

        # All of that came over one server-sent-event stream: the page never polled the metric
        # routes, and it got step, summary and layers events for both rounds of steps. The bits
        # history is the one read beside it, made only after a `layers` event said the metrics
        # changed (at most one per such event).
        streams = [u for u in requests if u.endswith(f"/v1/jobs/{job_id}/metrics/stream")]
        bits = [u for u in requests if "/metrics/layers/bits?" in u]
        polled = [u for u in requests if "/metrics/" in u and "/metrics/stream" not in u and u not in bits]
        assert len(streams) == 1 and polled == [], (streams, polled)
        events = page.evaluate("() => window.tailDashboard.state.events")
        assert events["step"] >= 7 and events["summary"] >= 2 and events["layers"] >= 2, events
        assert 2 <= len(bits) <= events["layers"], (bits, events)
        assert not page.evaluate("() => window.tailDashboard.state.ended")

        # The job ends: its metrics drain, step 7 becomes final, and the stream says `end`.
        with open_storage(db) as store:
            store.update_job_status(job_id, "SUCCEEDED", ended_at=time.time() - 60)
        page.wait_for_function("() => window.tailDashboard.state.ended", timeout=30_000)
        assert page.evaluate("() => window.tailDashboard.state.lastStep") == 7
        assert page.locator("#conn").inner_text() == "job ended; all metrics shown"
        page.wait_for_function(
            "() => document.getElementById('job-title').textContent.endsWith('SUCCEEDED')", timeout=30_000
        )
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)


def test_guarded_reads_ask_for_the_token_once_per_tab(tmp_path: Path, page: Page) -> None:
    """Reads need the token (a service bound beyond loopback, here forced by the setting): the
    page asks for it once, keeps it for the tab (sessionStorage: a reload does not ask again)
    and never writes it to localStorage."""
    db = tmp_path / "db.sqlite"
    with open_storage(db) as store:
        store.insert_job(
            job_id="guarded-job", name="guarded", source="api", status="SUCCEEDED",
            entrypoint="python -m jobs.train", spec={"method": "tail"},
        )  # fmt: skip
    with LiveServer(make_settings(db, None, read_requires_token=True)) as server:
        page.goto(f"{server.url}/?poll_ms=300")
        page.wait_for_selector("#token-form:not([hidden])", timeout=30_000)
        assert page.locator("#jobs-table tbody tr").count() == 0
        page.fill("#token", API_TOKEN)
        page.click("#token-form button")
        page.wait_for_function(
            "() => document.querySelector('#jobs-table tbody tr') !== null", timeout=30_000
        )
        assert page.locator("#jobs-table tbody tr").first.inner_text().startswith("guarded")
        assert page.locator("#token-form").is_hidden()
        page.reload()
        page.wait_for_function(
            "() => document.querySelector('#jobs-table tbody tr') !== null", timeout=30_000
        )
        assert page.locator("#token-form").is_hidden()
        assert page.evaluate("() => sessionStorage.getItem('tailRayToken')") == API_TOKEN
        assert page.evaluate("() => localStorage.getItem('tailRayToken')") is None
