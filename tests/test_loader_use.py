"""The loader CPU a server uses (issue [6/6]): cores used over the last minute, per GPU fed, and each step's
preprocessing tail over the ranks served; on a fake clock, then on a real `packfeed serve` streaming two ranks,
read from /status.json and Prometheus's /metrics."""

from __future__ import annotations

import json
import time

import pytest

from packfeed.server.serve.loader_use import LoaderUse


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_cores_per_gpu_and_the_step_tail_count_what_was_sent():
    clock = Clock()
    use = LoaderUse(window_s=60, clock=clock)
    assert use.snapshot() == {"cores_used": 0.0, "gpus_fed": 0, "cores_per_gpu": None, "step_tail": {}}
    # two ranks streaming, each with a second pipeline stage fed the same packs (a replica: no CPU of its own)
    use.streaming("j", 0, +1), use.streaming("j", 1, +1)
    assert use.sent("j", "r0", 0, (0, 0), 2.0, True) is None  # rank 1's step 0 not sent yet
    assert use.sent("j", "r0.s1", 0, (0, 0), 2.0, False) is None
    clock.now += 10
    assert use.sent("j", "r1", 1, (0, 0), 6.0, True) == pytest.approx(6.0 / 4.0)  # slowest over the mean
    use.sent("j", "r1.s1", 1, (0, 0), 6.0, False)
    snapshot = use.snapshot()
    assert snapshot["gpus_fed"] == 4 and snapshot["cores_used"] == pytest.approx(8.0 / 10.0)
    assert snapshot["cores_per_gpu"] == pytest.approx(0.2) and snapshot["step_tail"] == {"j": 1.5}
    use.streaming("j", 1, -1)  # rank 1's stream ended: rank 0's steps no longer wait for it
    assert use.sent("j", "r0", 0, (0, 1), 3.0, True) == 1.0
    clock.now += 61  # a minute later nothing was sent: nothing is used
    assert use.snapshot()["cores_used"] == 0.0 and use.snapshot()["gpus_fed"] == 0
    use.forget("j")
    assert use.snapshot()["step_tail"] == {}


def test_a_server_shows_the_cores_it_uses_per_gpu(small_tile_index):
    from packfeed.client import LocalServer, PackStream
    from ports import free_port
    from test_status_page import get

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with LocalServer(small_tile_index, workers=1, metrics_port=port) as server:
        streams = [PackStream(server.target, job="fed", rank=rank, dp=2, microbatches=2) for rank in (0, 1)]
        steps = [iter(stream) for stream in streams]
        for _ in range(3):
            for it in steps:
                next(it)
        deadline = time.monotonic() + 30
        while True:  # a step counts once both ranks' rank-steps have gone out
            loader = json.loads(get(f"{base}/status.json")[1])["loader"]
            if "fed" in loader["step_tail"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        metrics = get(f"{base}/metrics")[1].decode()
        for stream in streams:
            stream.close()
    assert loader["gpus_fed"] == 2 and loader["cores_used"] > 0
    assert loader["cores_per_gpu"] == pytest.approx(loader["cores_used"] / 2, abs=2e-3)
    assert loader["step_tail"]["fed"] >= 1.0
    assert "packfeed_loader_cores_per_gpu " in metrics and 'packfeed_step_preprocessing_tail_count{job="fed"}' in metrics
