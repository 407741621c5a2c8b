"""The status page in a real headless Chromium (the system's package, driven by Playwright with that
executable; no browser download): while a job streams, the page shows the job and its ranks and its figures
change between two looks; with a token set, the page asks for it (typed in, or given in the address's fragment,
which it then drops from the address) and sends it as a header, never in an address. Chromium is installed by
apt-get where missing (as `make docker-test` installs docker), else the test says why it skips."""

from __future__ import annotations

import os
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


def stream_slowly(target: str, stop: threading.Event) -> None:
    """Rank 0 of a DP 1 job, one step every 0.3 s, until told to stop or the job ends."""
    from packfeed.client import PackStream

    with PackStream(target, job="watched", rank=0, dp=1, microbatches=1, epochs=20, token="s3cret") as stream:
        for _ in stream:
            if stop.wait(0.3):
                return


def test_the_page_shows_a_streaming_job_and_refreshes_itself(chromium, small_tile_index):
    from packfeed.client import LocalServer
    from playwright.sync_api import sync_playwright
    from ports import free_port

    port = free_port()
    with LocalServer(small_tile_index, workers=1, metrics_port=port, env={"PACKFEED_AUTH_TOKEN": "s3cret"}) as server:
        stop = threading.Event()
        streamer = threading.Thread(target=stream_slowly, args=(server.target, stop), daemon=True)
        streamer.start()
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
                page = browser.new_page()
                requests: list[str] = []
                page.on("request", lambda request: requests.append(request.url))
                page.goto(f"http://127.0.0.1:{port}/status#token=s3cret")
                job = page.locator('section.job[data-job="watched"]')
                job.wait_for(timeout=30_000)
                assert "isf+balance" in job.inner_text() and "DP 1 x M 1" in job.inner_text()
                first = job.locator("table").first.inner_text()
                assert "acknowledged" in first and "\n0\t" in first  # rank 0's row
                deadline = time.monotonic() + 20
                later = first
                while later == first and time.monotonic() < deadline:
                    page.wait_for_timeout(1000)
                    later = job.locator("table").first.inner_text()
                assert later != first, "the page did not change while the job streamed"
                assert "s3cret" not in page.url and not any("s3cret" in url for url in requests)
                browser.close()
        finally:
            stop.set()
            streamer.join(timeout=30)
