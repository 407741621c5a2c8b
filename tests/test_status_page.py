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
    import time

    from packfeed.client import LocalServer, PackStream
    import grpc

    from packfeed.v1 import packfeed_pb2 as pb
    from packfeed.v1 import packfeed_pb2_grpc as pb_grpc
    from ports import free_port

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with LocalServer(small_tile_index, workers=1, metrics_port=port) as server:
        with PackStream(server.target, job="watched", rank=1, dp=2, microbatches=2, epochs=3) as stream:
            # the opened job's first history points, before any step: the steps below (and the server's prefetch,
            # which may all go out within one 2 s interval) then fall between points, whatever their speed
            deadline = time.monotonic() + 20
            while not [j["history"] for j in json.loads(get(f"{base}/status.json")[1])["jobs"]
                       if j["job"] == "watched" and j["history"]] and time.monotonic() < deadline:
                time.sleep(0.25)
            steps = iter(stream)
            next(steps)
            next(steps)  # the first step acknowledged, with the trainer's data wait
            deadline = time.monotonic() + 20  # the acknowledgement travels on its own: read once it has arrived
            while True:
                first = json.loads(get(f"{base}/status.json")[1])
                (watched,) = [j for j in first["jobs"] if j["job"] == "watched"]
                if watched["ranks"][1]["acked"] is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            next(steps)
            next(steps)
            deadline = time.monotonic() + 20  # the history's points come every 2 s, from the server's own clock
            while True:
                second = json.loads(get(f"{base}/status.json")[1])
                (history,) = [j["history"] for j in second["jobs"] if j["job"] == "watched"]
                if len(history) >= 2 and any(point[1] > 0 for point in history) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            state = stream.state_dict()
        after = json.loads(get(f"{base}/status.json")[1])  # the run stopped early, 5 steps prefetched or more
        with PackStream(server.target, job="watched", rank=1, dp=2, microbatches=2, epochs=3) as stream:
            stream.load_state_dict(state)
            next(iter(stream))
            again = json.loads(get(f"{base}/status.json")[1])
        for rank in (0, 1):  # a small job read to its end by both ranks, then closed
            with PackStream(server.target, job="done", rank=rank, dp=2, microbatches=1, epochs=1) as stream:
                list(stream)
        deadline = time.monotonic() + 20  # the history point after the burst (points every 2 s)
        while True:
            finished = json.loads(get(f"{base}/status.json")[1])
            if [j for j in finished["jobs"] if j["job"] == "done" and any(p[1] > 0 for p in j["history"])] \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        pb_grpc.PackfeedStub(grpc.insecure_channel(server.target)).CloseJob(pb.CloseJobRequest(job="done"))
        closed = json.loads(get(f"{base}/status.json")[1])
        code_page, page = get(f"{base}/status")
        code_metrics, metrics = get(f"{base}/metrics")
    assert code_page == 200 and code_metrics == 200
    assert b"status.json" in page and b"packfeed_packs_total" in metrics
    (job,) = [j for j in first["jobs"] if j["job"] == "watched"]
    assert job["state"] == "live" and job["plan"]["dp"] == 2 and job["plan"]["strategy"] == "isf+balance"
    counts = job["plan"]["epoch_steps"]
    assert len(counts) == 3 and min(counts) > 0 and job["plan"]["steps"] == sum(counts)
    assert not job["plan"]["steps_estimated"]
    assert job["balance"]["known"] and 0 <= job["balance"]["llm_dist"] < 1
    rank = job["ranks"][1]
    assert rank["acked"] == [0, 0] and rank["done_steps"] == 1 and rank["streamed"][1] >= 0 and rank["data_wait_s"] > 0
    assert job["ranks"][0]["acked"] is None and job["ranks"][0]["streamed"] is None  # rank 0 never streamed
    assert job["done_steps"] == 0  # the job's progress is its slowest rank's
    (later,) = [j for j in second["jobs"] if j["job"] == "watched"]
    assert later["ranks"][1]["done_steps"] == 3 and later["throughput"]["packs"] > job["throughput"]["packs"]
    assert len(later["history"]) >= 2 and any(point[1] > 0 for point in later["history"])
    (stopped,) = [j for j in after["jobs"] if j["job"] == "watched"]
    assert stopped["state"] == "idle" and stopped["ranks"][1]["lag_steps"] == 0 == stopped["ranks"][1]["queued_steps"]
    (resumed,) = [j for j in again["jobs"] if j["job"] == "watched"]
    assert resumed["ranks"][1]["lag_steps"] <= 1 + 8  # this run's: one step in the trainer, the prefetch at most
    (done,) = [j for j in finished["jobs"] if j["job"] == "done"]
    assert done["state"] == "finished" and done["done_steps"] == done["plan"]["steps"] > 0
    # read to its end within moments of its open, maybe before the history's first point (which measures from the
    # open) or across it: either way the burst shows (measured only between points, it was lost)
    assert any(point[1] > 0 for point in done["history"]) and done["throughput"]["samples"] > 0
    assert [c["job"] for c in closed["closed_jobs"]] == ["done"] and closed["closed_jobs"][0]["state"] == "closed"
    assert "done" not in [j["job"] for j in closed["jobs"]]
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
