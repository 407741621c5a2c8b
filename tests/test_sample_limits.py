"""Samples too large for the server's memory: a pixel limit per image and a token limit per sample refuse them at
index time (before anything decodes or tokenises them whole), and what a raised limit lets through is prepared
within the memory budget, or skipped with its reason where one sample alone would not fit it."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from packfeed.client import LocalServer, PackStream
from packfeed.media.samples import SERVE_SKIP_CATEGORIES
from packfeed.server.serve.worker_process import GIVE_BACK_AFTER_S, KEEP_FREED_BYTES
from ports import free_port
from test_integrity import conversation, write_tar

HUGE_SIDE = 9400  # 88.4 MP: under Pillow's decompression-bomb limit, a PNG of a few hundred KB
MiB = 1 << 20


@pytest.fixture(scope="module")
def huge_shard(tmp_path_factory, demo_dataset) -> Path:
    """A 9,400 x 9,400 PNG, a 4.2M-token conversation, a 300k-token one and a few ordinary samples."""
    root = tmp_path_factory.mktemp("huge")
    image = io.BytesIO()
    Image.new("RGB", (HUGE_SIDE, HUGE_SIDE), (90, 120, 200)).save(image, format="PNG")
    assert len(image.getvalue()) < 1 << 20
    small = io.BytesIO()
    Image.new("RGB", (320, 240), (200, 40, 40)).save(small, format="JPEG")
    samples = [{"__key__": "huge-image", "png": image.getvalue(), "json": conversation("<image>\nColour?", "Blue.")},
               {"__key__": "huge-text", "json": conversation("Count:", "x " * 2_100_000)},  # 2 tokens per "x "
               {"__key__": "long-text", "json": conversation("Count:", "x " * 150_000)}]
    samples += [{"__key__": f"small{i}", "jpg": small.getvalue(),
                 "json": conversation("<image>\nWhat colour?", "Red " * (i + 1))} for i in range(5)]
    write_tar(root / "huge.tar", samples)
    return root / "huge.tar"


# `packfeed index` run in a process that reports its own peak RSS and its workers' (the last line of stderr), in
# KiB. Its own is VmHWM: Linux keeps ru_maxrss across exec, so it would report this test process's peak.
_MEASURED = ("import os, resource, sys\nfrom packfeed.cli import main\nsys.argv = ['packfeed', *sys.argv[1:]]\n"
             "code = main()\nstatus = open(f'/proc/{os.getpid()}/status').read().split('VmHWM:')[1].split()[0]\n"
             "print(max(int(status), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss), file=sys.stderr)\n"
             "sys.exit(code)\n")


def index_with(shard: Path, out: Path, tokenizer, *flags: str) -> tuple[dict[str, str | None], float]:
    """`packfeed index` in its own process: ({key: reason (None: valid)}, its peak RSS in MiB)."""
    done = subprocess.run([sys.executable, "-c", _MEASURED, "index", str(shard), "--out", str(out), "--tokenizer",
                           str(tokenizer), "--image-size", "112", "--image-tokens", "16", "--max-tiles", "4",
                           "--quiet", *flags], capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 3), done.stderr
    table = pq.read_table(out, columns=["key", "reason"]).to_pylist()
    return {row["key"]: row["reason"] for row in table}, int(done.stderr.split()[-1]) / 1024


def test_a_huge_image_and_a_huge_text_are_refused_at_index_time_under_the_default_limits(huge_shard, tmp_path,
                                                                                        demo_dataset):
    reasons, peak_mib = index_with(huge_shard, tmp_path / "index.parquet", demo_dataset.tokenizer)
    assert "over max_image_pixels 50,000,000" in reasons["huge-image"]
    assert "over max_sample_tokens" in reasons["huge-text"] and "too long" in reasons["huge-text"]
    assert "too long" in reasons["long-text"]  # 300k tokens: over the 262,144 default
    assert all(reasons[f"small{i}"] is None for i in range(5))
    # neither was decoded nor tokenised whole: 88 MP decode in ~850 MB, 4M tokens in ~1.5 GB
    assert peak_mib < 600, f"indexing peaked at {peak_mib:.0f} MiB"
    # a sample just over the limit is counted exactly (text, template and image placeholders)
    reasons, _ = index_with(huge_shard, tmp_path / "tight.parquet", demo_dataset.tokenizer, "--max-sample-tokens",
                            "300005")
    assert reasons["long-text"].startswith("too long: 300,0") and "tokens, over max_sample_tokens 300,005" in \
        reasons["long-text"]


def tree_pss(pid: int) -> int:
    """Proportional set size of a process and its children: shared memory (the steps' files mapped by the
    server and a worker, shared libraries) counted once, not once per process as RSS sums would."""
    total = 0
    try:
        processes = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return 0
    for process in processes:
        try:
            total += process.memory_full_info().pss
        except psutil.Error:
            pass
    return total


def skip_labels(port: int) -> set[str]:
    """The `reason` labels of a server's packfeed_skipped_samples_total series."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return set(re.findall(r'^packfeed_skipped_samples_total\{[^}]*reason="([^"]*)"', text, re.MULTILINE))


def served_peak(config: Path, budget_mb: int, small_tile_index, metrics_port: int = 0
                ) -> tuple[set[str], list[tuple[str, str]], int, set[str]]:
    """Serve the dataset `huge` once at DP 1 under a budget: (keys served, (key, reason) skipped, peak PSS growth
    of the server tree over its idle footprint with its worker started, after an ordinary warm-up job, the skip
    metric's reason labels when `metrics_port` is given)."""
    with LocalServer(config=config, workers=1, extra_args=["--memory-budget-mb", str(budget_mb)],
                     metrics_port=metrics_port or None) as server:
        with PackStream(server.target, job="warm", dataset="small", rank=0, dp=1) as warm:
            assert sum(1 for _ in warm)
        time.sleep(GIVE_BACK_AFTER_S + 1.5)  # the worker gives back what it kept for the warm-up's steps
        idle, peak, done = tree_pss(server.process.pid), [0], threading.Event()

        def watch():
            while not done.is_set():
                peak[0] = max(peak[0], tree_pss(server.process.pid))
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with PackStream(server.target, job="huge", dataset="huge", rank=0, dp=1) as stream:
                steps = list(stream)
        finally:
            done.set()
            watcher.join()
        labels = skip_labels(metrics_port) if metrics_port else set()
    keys = {key for step in steps for key in step.sample_keys}
    skipped = [(key, reason) for step in steps for pack in step.packs for key, reason in pack.skipped]
    return keys, skipped, peak[0] - idle, labels


@pytest.mark.parametrize("budget_mb, pixels", [(64, "exact"), (512, "fast")])
def test_raised_limits_are_served_within_the_memory_budget(huge_shard, tmp_path, demo_dataset, small_tile_index,
                                                           budget_mb, pixels):
    """With the limits raised, the 88 MP image (exact: ~840 MiB to decode; fast: ~340) and the 300k-token text
    (~115 MiB to tokenise) are prepared where the budget holds them, and skipped with the reason where one of
    them alone needs more: the server tree never grows past the budget plus what a worker keeps for reuse."""
    path = tmp_path / "index.parquet"
    reasons, _ = index_with(huge_shard, path, demo_dataset.tokenizer, "--max-image-pixels", "100000000",
                            "--max-sample-tokens", "400000")
    assert reasons["huge-image"] is None and reasons["long-text"] is None and "too long" in reasons["huge-text"]
    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump({"max_skipped_fraction": 1.0,  # the long text is alone in its step
                                      "datasets": {"huge": {"index": str(path), "pixels": pixels},
                                                   "small": {"index": str(small_tile_index), "pixels": pixels}}}))
    keys, skipped, growth, labels = served_peak(config, budget_mb, small_tile_index, free_port())
    small = {f"small{i}" for i in range(5)}
    if budget_mb == 64:
        assert keys == small
        assert {key for key, _ in skipped} >= {"huge-image", "long-text"}
        assert any("decoding 9400x9400 needs ~842 MiB, more than the server's memory budget allows one sample (64 MiB)"
                   in reason for key, reason in skipped if key == "huge-image")
        # the metric counts them by category, never by the file or key its reason names
        assert "over the memory budget" in labels
        assert labels <= set(SERVE_SKIP_CATEGORIES) | {"other"}, labels
    else:
        assert keys == small | {"huge-image", "long-text"}
    assert growth <= budget_mb * MiB + KEEP_FREED_BYTES, f"grew {growth / MiB:.0f} MiB over a {budget_mb} MiB budget"
