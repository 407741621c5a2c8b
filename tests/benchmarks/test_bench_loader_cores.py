"""Predicted against measured loader CPU (issue [6/6]): this machine calibrated (`packfeed calibrate`'s set, kept
in a folder of the run's own), each sample's preprocessing seconds predicted from the index
(`packfeed.server.index.cpu_features` x the model), against the workers' CPU measured from outside (/proc) while a
`packfeed serve` with one worker, warmed by a first job (its worker forked and its libraries loaded: what a worker
pays once in its life is not a sample's), delivers two epochs, for `exact` and `fast`, on the demo photographs
and on document scans; beside it, what the server itself counted (`packfeed_loader_cpu_seconds_total`). Rounds
interleaved; the median and the spread printed.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_loader_cores.py -m benchmark
"""

from __future__ import annotations

import os
import statistics

import pytest

from test_bench_cpu_per_sample import EPOCHS, dataset, wait_until_idle, workers_cpu_seconds

pytestmark = pytest.mark.benchmark
ROUNDS = int(os.environ.get("PACKFEED_BENCH_ROUNDS", "3"))


def warm_worker_cpu(index, pixels: str) -> dict[str, float]:
    """Workers' CPU (from /proc) and the server's own count over a two-epoch job on a server a first job warmed."""
    import re
    import urllib.request

    import yaml

    from packfeed.client import LocalServer, PackStream
    from ports import free_port

    config = index.parent / f"server-{pixels}.yaml"
    config.write_text(yaml.safe_dump({"datasets": {"demo": {"index": str(index), "pixels": pixels}}}))
    port = free_port()
    with LocalServer(config=config, workers=1, metrics_port=port) as server:
        wait_until_idle(server)
        for step in PackStream(server.target, job="warm", rank=0, dp=1, microbatches=2, epochs=1):
            pass
        before, samples = workers_cpu_seconds(server.process.pid), 0
        with PackStream(server.target, job="measured", rank=0, dp=1, microbatches=2, epochs=EPOCHS) as stream:
            for step in stream:
                samples += len(step.sample_keys)
        measured = workers_cpu_seconds(server.process.pid) - before
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        counted = float(re.search(r'packfeed_loader_cpu_seconds_total\{job="measured"\} (\S+)', text).group(1))
    return {"samples": samples, "workers": measured, "counted": counted}


@pytest.mark.parametrize("images", ["photographs", "scans"])
def test_predicted_against_measured_loader_cpu(tmp_path, monkeypatch, images):
    pytest.importorskip("cv2")
    monkeypatch.setenv("PACKFEED_CACHE", str(tmp_path / "cache"))
    from packfeed.server.tools.calibrate import calibrate
    from packfeed.server.tools.loader_cores import preprocessing_ms
    from packfeed.v1.options import PixelMode

    _, _, index = dataset(tmp_path, images)
    modes = [PixelMode.EXACT, PixelMode.FAST]
    models = calibrate(modes, rounds=5)
    for name, model in models.items():
        print(f"\n[loader cores] calibration {name}: fit {model.fit}")
    predicted = {mode.value: found["ms_per_sample"]["mean"]
                 for mode, found in zip(modes, preprocessing_ms(index, modes, measure=False).values())}
    ratios: dict[str, list[float]] = {mode.value: [] for mode in modes}
    for _ in range(ROUNDS):
        for mode in modes:
            served = warm_worker_cpu(index, mode.value)
            measured = served["workers"] / served["samples"] * 1e3
            ratios[mode.value].append(predicted[mode.value] / measured)
            print(f"[loader cores] {images} {mode.value}: predicted {predicted[mode.value]:.2f} ms per sample, the "
                  f"workers measured {measured:.2f} ms ({served['samples']} samples, {EPOCHS} epochs; the server "
                  f"counted {served['counted'] / served['samples'] * 1e3:.2f} ms): predicted / measured "
                  f"{predicted[mode.value] / measured:.3f}")
    for mode, values in ratios.items():
        median = statistics.median(values)
        print(f"[loader cores] {images} {mode}: predicted / measured median {median:.3f} (spread {min(values):.3f}-"
              f"{max(values):.3f}, {ROUNDS} rounds); within 15%: {abs(median - 1) <= 0.15}")
