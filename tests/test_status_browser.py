"""The status page in a real headless Chromium (the system's package, driven by Playwright with that
executable; no browser download): while a job streams, the page shows the job and its ranks and its figures
change between two looks; with a token set, the page asks for it (typed in, or given in the address's fragment,
which it then drops from the address) and sends it as a header, never in an address. Chromium is installed by
apt-get where missing (as `make docker-test` installs docker), else the test says why it skips."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time

import pytest

pytest.importorskip("playwright")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=300)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], capture_output=True, timeout=900,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        path = shutil.which("chromium")
    if path is None:
        pytest.skip("no chromium, and apt-get could not install it (apt-get install chromium)")
    return path


def open_status(playwright, chromium: str, port: int):
    """(browser, page) with the status page of the server whose metrics port is `port` open (no token)."""
    browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
    page = browser.new_page()
    page.goto(f"http://127.0.0.1:{port}/status")
    return browser, page


def stream_slowly(target: str, stop: threading.Event) -> None:
    """Rank 0 of a DP 2 job (rank 1 never reads), one step every 0.3 s, until told to stop (the job's 200 epochs
    last over 5 minutes: on a loaded machine the page's checks may take minutes, and a job whose stream ended
    would show `idle`)."""
    from packfeed.client import PackStream

    with PackStream(target, job="watched", rank=0, dp=2, microbatches=1, epochs=200, token="s3cret") as stream:
        for _ in stream:
            if stop.wait(0.3):
                return


def test_the_page_shows_a_streaming_job_and_refreshes_itself(chromium, small_tile_index, tmp_path):
    from packfeed.client import LocalServer, PackStream
    from playwright.sync_api import sync_playwright
    from ports import free_port

    port = free_port()
    with LocalServer(small_tile_index, workers=1, metrics_port=port, env={"PACKFEED_AUTH_TOKEN": "s3cret"}) as server:
        stop = threading.Event()
        streamer = threading.Thread(target=stream_slowly, args=(server.target, stop), daemon=True)
        streamer.start()
        with PackStream(server.target, job="short", rank=0, dp=1, microbatches=1, epochs=1, token="s3cret") as done:
            list(done)  # a finished job beside the live one
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
                asked = browser.new_page()  # no token: the page asks for it, and shows once it is typed in
                asked.goto(f"http://127.0.0.1:{port}/status")
                asked.locator("#login").wait_for(state="visible", timeout=30_000)
                assert asked.locator("section.job").count() == 0
                asked.fill("#token", "wrong")
                asked.click("#login button")
                asked.get_by_text("that token was refused").wait_for(timeout=30_000)
                asked.fill("#token", "s3cret")
                asked.click("#login button")
                asked.locator('section.job[data-job="watched"]').wait_for(timeout=30_000)
                hashed = browser.new_page()  # a token put into an open page's address: taken without a reload
                hashed.goto(f"http://127.0.0.1:{port}/status")
                hashed.locator("#login").wait_for(state="visible", timeout=30_000)
                hashed.evaluate("location.hash = '#token=s3cret'")
                hashed.locator('section.job[data-job="watched"]').wait_for(timeout=30_000)
                assert "s3cret" not in hashed.url and hashed.locator("#login").is_hidden()
                page = browser.new_page()
                requests: list[str] = []
                page.on("request", lambda request: requests.append(request.url))
                page.goto(f"http://127.0.0.1:{port}/status#token=s3cret")
                job = page.locator('section.job[data-job="watched"]')
                job.wait_for(timeout=30_000)
                assert "isf+balance" in job.inner_text() and "DP 2 x M 1" in job.inner_text()
                assert job.get_attribute("data-state") == "live" and job.locator(".state").inner_text() == "live"
                finished = page.locator('section.job[data-job="short"]')
                assert finished.get_attribute("data-state") == "finished"
                total = int(finished.locator(".progress").inner_text().split(" of ")[1].split()[0].replace(",", ""))
                assert finished.locator(".progress").inner_text().startswith(f"step {total:,} of {total:,}")
                ranks = job.locator("table.ranks")
                first = ranks.inner_text()
                assert "acknowledged" in first and re.search(r"\n1\t\s*- of [\d,]+\t-\t-\t", first)  # never read
                assert "step - of " in job.locator(".progress").inner_text()  # the job is as far as its slowest rank
                deadline = time.monotonic() + 20
                later = first
                while later == first and time.monotonic() < deadline:
                    page.wait_for_timeout(1000)
                    later = ranks.inner_text()
                assert later != first, "the page did not change while the job streamed"
                cells = [ranks.locator("tr").nth(r).locator("td").all_inner_texts() for r in (1, 2)]
                lags = [int(row[4]) for row in cells]  # the current run's: at most the steps in flight
                assert 0 <= lags[0] <= 40 and lags[1] == 0 and cells[1][2:4] == ["-", "-"]
                width = ranks.locator("tr").nth(1).locator(".bar > span").evaluate("e => e.style.width")
                assert 0 < float(width.rstrip("%")) < 100  # rank 0's bar: part of the way
                charts = job.locator("svg.chart")
                deadline = time.monotonic() + 20
                while int(charts.first.get_attribute("data-points")) < 2 and time.monotonic() < deadline:
                    page.wait_for_timeout(1000)
                assert charts.count() == 2 and int(charts.first.get_attribute("data-points")) >= 2
                assert "samples/s" in job.locator("figcaption").first.inner_text()
                shot = page.screenshot(path=str(tmp_path / "status.png"), full_page=True)
                assert len(shot) > 20_000  # a drawn page, not a blank one (the file stays for a person to look at)
                assert "s3cret" not in page.url and not any("s3cret" in url for url in requests)
                browser.close()
        finally:
            stop.set()
            streamer.join(timeout=30)


def test_a_job_is_live_while_its_trainer_works_through_what_it_was_sent_then_finished(chromium, small_tile_index):
    """The server sent a job's last step long before a slow trainer is through: the page shows the job `live`,
    with the steps in the trainer's hands as its lag, until it acknowledges the last one: then `finished`."""
    import grpc

    from packfeed.client import LocalServer, PackStream
    from packfeed.v1 import packfeed_pb2 as pb, packfeed_pb2_grpc as pb_grpc
    from playwright.sync_api import sync_playwright
    from ports import free_port

    port = free_port()
    with LocalServer(small_tile_index, workers=1, metrics_port=port) as server, \
            PackStream(server.target, job="slow", rank=0, dp=1, microbatches=1, prefetch=64) as stream:
        total = len(stream)
        next(stream)  # one step in hand; the client receives every other step meanwhile
        stub = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target))
        deadline = time.monotonic() + 60
        while stub.GetJob(pb.GetJobRequest(job="slow")).ranks[0].streamed_step < total - 1:
            assert time.monotonic() < deadline, "the server did not send the whole job"
            time.sleep(0.2)
        with sync_playwright() as playwright:
            browser, page = open_status(playwright, chromium, port)
            job = page.locator('section.job[data-job="slow"]')
            job.wait_for(timeout=30_000)
            assert job.get_attribute("data-state") == "live"  # its stream ended: the trainer still works
            lag = int(job.locator("table.ranks tr").nth(1).locator("td").nth(4).inner_text())
            assert lag == total  # every step sent, none acknowledged yet
            assert len(list(stream)) == total - 1  # the trainer goes through the rest
            page.locator('section.job[data-job="slow"][data-state="finished"]').wait_for(timeout=30_000)
            assert int(job.locator("table.ranks tr").nth(1).locator("td").nth(4).inner_text()) == 0
            assert job.locator(".progress").inner_text().startswith(f"step {total:,} of {total:,}")
            browser.close()


def test_the_dataset_report_reads_as_a_report(chromium, small_tile_index, tmp_path):
    """`packfeed stats`'s report.html in the browser on a laptop's screen: its figures side by side in a grid no
    taller than the screen, each with its caption, the distribution figures whole numbers (no 3904.0399...), what
    the collective-safe layout costs the balance, and a screenshot of it."""
    from playwright.sync_api import sync_playwright

    from packfeed.server.tools.stats import write_report
    from packfeed.v1.options import PlanConfig

    paths = write_report(small_tile_index, tmp_path / "report", PlanConfig(dp=2, microbatches=2))
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1366, "height": 768})  # a laptop's screen
        page.goto(paths["html"].as_uri())
        grid = page.locator(".figs").bounding_box()
        assert grid["height"] <= 768, grid  # every figure in one screen's height
        figures = page.locator("figure")
        assert figures.count() >= 6
        boxes = [figures.nth(k).bounding_box() for k in range(figures.count())]
        rows = sorted({round(box["y"]) for box in boxes})
        assert len(rows) < len(boxes) and all(box["width"] < 700 for box in boxes)  # a grid, not one column
        assert all(box["x"] + box["width"] <= 1366 for box in boxes)  # all of it on the screen's width
        captions = [figures.nth(k).locator("figcaption").inner_text() for k in range(figures.count())]
        assert all(len(caption) > 20 for caption in captions)
        distributions = page.locator("table").nth(0 if "Invalid" not in page.content() else 1).inner_text()
        assert "llm tokens" in distributions and not re.search(r"\d\.\d{3,}", distributions)
        note = page.locator("p.note").inner_text()  # the plans' layout, and what it costs the balance
        assert "collective-safe" in note and "LLM Dist" in note
        assert "isf+balance, not collective-safe" in page.locator("table").last.inner_text()
        shot = page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        assert len(shot) > 50_000
        browser.close()


def test_the_reports_count_histograms_tick_whole_numbers():
    """Images per sample drawn as counts: ticks 0, 1, 2, never -0.5 ... 1.5."""
    import matplotlib.pyplot as plt
    import numpy as np

    from packfeed.server.tools.stats import _hist

    fig, ax = plt.subplots()
    _hist(np.array([0, 0, 0, 1, 1, 2]), "Images per sample", "images", integer=True)(ax)
    fig.canvas.draw()
    ticks = [tick for tick in ax.get_xticks() if ax.get_xlim()[0] <= tick <= ax.get_xlim()[1]]
    plt.close(fig)
    assert ticks and all(float(tick).is_integer() for tick in ticks), ticks


def test_a_moving_mixtures_weights_are_charted_over_the_epoch(chromium, demo_dataset, tmp_path):
    """A mixture whose weights move, served whole: the page draws one line per dataset through every window's
    weights, and names the window in force with its weights."""
    from packfeed.client import LocalServer, PackStream
    from playwright.sync_api import sync_playwright
    from ports import free_port
    from test_moving_mixture import served_schedule

    port, path = free_port(), served_schedule(tmp_path, demo_dataset.tokenizer)
    with LocalServer(None, workers=1, metrics_port=port, extra_args=["--mixture", str(path)]) as server:
        with PackStream(server.target, job="annealed", rank=0, dataset="anneal", dp=1, microbatches=1,
                        window=12) as stream:
            list(stream)
        with sync_playwright() as playwright:
            browser, page = open_status(playwright, chromium, port)
            chart = page.locator('section.job[data-job="annealed"] figure.weights')
            chart.wait_for(timeout=30_000)
            lines = chart.locator("polyline")
            assert lines.count() == 2 and chart.locator("svg").get_attribute("data-windows") == "5"
            assert sorted(line.get_attribute("data-dataset") for line in lines.all()) == ["chat", "ocr"]
            ocr = [tuple(map(float, point.split(","))) for point in
                   chart.locator('polyline[data-dataset="ocr"]').get_attribute("points").split()]
            assert len(ocr) == 5 and ocr[0][1] < ocr[-1][1]  # y grows downwards: ocr's weight falls over the epoch
            caption = chart.locator("figcaption").inner_text()
            assert "in force, window 4" in caption and "ocr 0.2" in caption, caption
            browser.close()
