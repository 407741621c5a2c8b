"""`/status` and `/status.json` on a real `packfeed serve`'s metrics port while a job streams: the job, its plan
and balance, every rank's position and the data wait its trainer reports, figures that change between two
looks; with a token set, refused without it. (The page in a headless browser: test_status_browser.)"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest


def get(url: str, token: str = "") -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_the_status_shows_jobs_ranks_and_progress(small_tile_index):
    from packfeed.client import LocalServer, PackStream
    from ports import free_port

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with LocalServer(small_tile_index, workers=1, metrics_port=port) as server:
        with PackStream(server.target, job="watched", rank=1, dp=2, microbatches=2, epochs=3) as stream:
            steps = iter(stream)
            next(steps)
            next(steps)  # the first step acknowledged, with the trainer's data wait
            code, body = get(f"{base}/status.json")
            first = json.loads(body)
            next(steps)
            next(steps)
            second = json.loads(get(f"{base}/status.json")[1])
        code_page, page = get(f"{base}/status")
        code_metrics, metrics = get(f"{base}/metrics")
    assert code == 200 and code_page == 200 and code_metrics == 200
    assert b"status.json" in page and b"packfeed_packs_total" in metrics
    (job,) = [j for j in first["jobs"] if j["job"] == "watched"]
    assert job["plan"]["dp"] == 2 and job["plan"]["strategy"] == "isf+balance"
    assert job["balance"]["known"] and 0 <= job["balance"]["llm_dist"] < 1
    rank = job["ranks"][1]
    assert rank["acked"][1] >= 0 and rank["streamed"][1] >= rank["acked"][1] and rank["data_wait_s"] > 0
    assert job["ranks"][0]["streamed"] == [-1, -1]  # rank 0 never streamed
    (later,) = [j for j in second["jobs"] if j["job"] == "watched"]
    assert later["ranks"][1]["acked"] > rank["acked"] and later["throughput"]["packs"] > job["throughput"]["packs"]
    assert first["memory"]["budget_bytes"] > 0


def test_with_a_token_the_status_figures_need_its_header_and_never_take_it_from_the_address(small_tile_index):
    from packfeed.client import LocalServer
    from ports import free_port

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with LocalServer(small_tile_index, workers=1, metrics_port=port, env={"PACKFEED_AUTH_TOKEN": "s3cret"}):
        assert get(f"{base}/status.json")[0] == 401
        assert get(f"{base}/status.json", token="wrong")[0] == 401
        code, body = get(f"{base}/status.json", token="s3cret")
        assert code == 200 and "jobs" in json.loads(body)
        for path in ("/status.json", "/status"):  # an address with the token is refused, whatever else it has
            code, body = get(f"{base}{path}?token=s3cret", token="s3cret")
            assert code == 400 and b"Authorization" in body
        code, page = get(f"{base}/status")  # the page holds no figures: it asks for the token
        assert code == 200 and b'id="login"' in page and b"s3cret" not in page
        assert get(f"http://127.0.0.1:{port}/metrics")[0] == 200  # Prometheus scrapes without it
