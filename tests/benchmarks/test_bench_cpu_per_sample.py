"""CPU seconds per delivered sample of the whole `packfeed serve` process tree (main process, the workers' fork
server, the workers, multiprocessing's resource tracker) from a job's open to its last byte, against InternVL's
training-time pre-processing written here as its loader runs it (each member read at its offset as a
file-per-image loader reads files, PIL decode, `dynamic_preprocess`'s grid + resize + crop + thumbnail, its
transform: ToTensor and ImageNet normalisation per tile, tokenising the conversation) on the same samples,
interleaved in one run, for each pixel mode (exact, fast, encoded: the client decodes, outside the measured
tree) and the bytes each puts on the wire; on the demo photographs and on generated document scans (1700 x
2200 text pages). Each mode's job runs two epochs on a fresh server with one worker, started and left to
settle first (what a server does once in its life, printed apart); the workers' own CPU is printed beside the
tree's.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_cpu_per_sample.py -m benchmark
"""

from __future__ import annotations

import io
import json
import os
import statistics
import time
from pathlib import Path

import pytest
from PIL import Image

from demo_data import indexed_demo

pytestmark = pytest.mark.benchmark
TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """user + system CPU of one process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:13]) / TICKS


def tree_cpu_seconds(pid: int) -> float:
    """user + system CPU of a process and its live descendants (and their reaped children)."""
    total, pids = 0.0, [pid]
    while pids:
        current = pids.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(v) for v in fields[11:15]) / TICKS  # utime, stime, cutime, cstime
            pids += [int(c) for c in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
        except OSError:
            continue
    return total


def dynamic_preprocess(image: Image.Image, image_size: int = 448, max_num: int = 12) -> list[Image.Image]:
    """InternVL's tiling (closest aspect ratio grid, resize, crop, thumbnail), as its training code does it."""
    width, height = image.size
    aspect, area = width / height, width * height
    ratios = sorted({(i, j) for n in range(1, max_num + 1) for i in range(1, n + 1) for j in range(1, n + 1)
                     if 1 <= i * j <= max_num}, key=lambda r: r[0] * r[1])
    best, best_diff = (1, 1), float("inf")
    for ratio in ratios:
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best_diff, best = diff, ratio
        elif diff == best_diff and area > 0.5 * image_size * image_size * ratio[0] * ratio[1]:
            best = ratio
    cols, rows = best
    resized = image.resize((cols * image_size, rows * image_size), Image.BICUBIC)
    tiles = [resized.crop((c * image_size, r * image_size, (c + 1) * image_size, (r + 1) * image_size))
             for r in range(rows) for c in range(cols)]
    if cols * rows != 1:
        tiles.append(image.resize((image_size, image_size), Image.BICUBIC))
    return tiles


def internvl_transform(image_size: int = 448):
    """InternVL's `build_transform` without its random JPEG re-encoding (an augmentation Packfeed does not do):
    RGB, resize to the tile, ToTensor, ImageNet normalisation; float32 CHW per tile, stacked per sample."""
    import torchvision.transforms as T
    from torchvision.transforms import InterpolationMode

    return T.Compose([T.Lambda(lambda img: img.convert("RGB") if img.mode != "RGB" else img),
                      T.Resize((image_size, image_size), interpolation=InterpolationMode.BICUBIC), T.ToTensor(),
                      T.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))])


def read_at(path: str, offset: int, size: int) -> bytes:
    """A member's bytes as a file-per-image loader reads an image file: open, seek, read, close."""
    with open(path, "rb") as file:
        file.seek(offset)
        return file.read(size)


def baseline_cpu_seconds(index: Path, tokenizer_path: Path) -> tuple[int, float]:
    """InternVL's training-time pre-processing, as its loader runs in a DataLoader worker (one torch thread), on
    the index's valid samples: each sample's JSON and images read at their offsets as files (`read_at`),
    `pil_loader` (open, RGB), `dynamic_preprocess`, its transform per tile, stacked, and the tokenizer."""
    import torch
    from tokenizers import Tokenizer

    from packfeed.server.index.table import read_index

    torch.set_num_threads(1)  # what PyTorch's DataLoader sets in its workers
    tokenizer, transform = Tokenizer.from_file(str(tokenizer_path)), internvl_transform()
    table, _ = read_index(index, columns=["shard", "valid", "json_offset", "json_size", "image_offsets",
                                          "image_sizes"])
    rows = [row for row in table.to_pylist() if row["valid"]]
    started = time.process_time()
    for row in rows:
        turns = json.loads(read_at(row["shard"], row["json_offset"], row["json_size"]))["conversations"]
        images = [Image.open(io.BytesIO(read_at(row["shard"], offset, size))).convert("RGB")
                  for offset, size in zip(row["image_offsets"], row["image_sizes"])]
        for image in images:
            tiles = dynamic_preprocess(image, max_num=max(1, 12 // len(images)) if len(images) > 1 else 12)
            torch.stack([transform(tile) for tile in tiles])
        tokenizer.encode_batch([t["value"] for t in turns])
    return len(rows), time.process_time() - started


EPOCHS = 2  # one job of two epochs, as a training run opens it


def wait_until_idle(server, timeout: float = 120.0) -> None:
    """Until the server has done what it does once in its life (its planner's warm-up, its workers' fork server
    loaded) and its tree's CPU stands still: what is measured from then on is what a job costs."""
    from processes import wait_for_start

    deadline = time.monotonic() + timeout
    wait_for_start(server, timeout)
    before = tree_cpu_seconds(server.process.pid)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = tree_cpu_seconds(server.process.pid)
        if now - before < 0.02:
            return
        before = now


def workers_cpu_seconds(server_pid: int) -> float:
    """CPU of the pre-processing workers alone (forks of the fork server, each started within the job)."""
    from processes import workers

    return sum(process_cpu_seconds(pid) for pid in workers(server_pid))


def served_cpu_seconds(index: Path, pixels: str = "exact") -> dict[str, float]:
    """What an operator pays for one job on a fresh server, 1 worker: the CPU of the whole `packfeed serve`
    process tree (main process, workers' fork server, workers, multiprocessing's resource tracker) from the
    job's open to its last byte, over EPOCHS epochs (`tree`); of the workers alone (`workers`) and of the main
    process alone (`main`: gRPC, planning, cutting PackParts); and, apart, what the server spent once, from its
    start until idle (`server_start`). Also `samples` and `wire` (bytes of the packs' tensors as received)."""
    import yaml

    from packfeed.client import LocalServer, PackStream

    config = index.parent / f"server-{pixels}.yaml"
    config.write_text(yaml.safe_dump({"datasets": {"demo": {"index": str(index), "pixels": pixels}}}))
    with LocalServer(config=config, workers=1) as server:
        pid = server.process.pid
        wait_until_idle(server)
        start_s, before, main_before = tree_cpu_seconds(pid), tree_cpu_seconds(pid), process_cpu_seconds(pid)
        samples = wire = 0
        with PackStream(server.target, job="measured", rank=0, dp=1, microbatches=2, epochs=EPOCHS,
                        prefetch=4) as stream:
            for step in stream:
                samples += len(step.sample_keys)
                wire += step.nbytes
        time.sleep(0.5)  # the last step's accounting in the server
        return {"samples": samples, "tree": tree_cpu_seconds(pid) - before, "workers": workers_cpu_seconds(pid),
                "main": process_cpu_seconds(pid) - main_before, "server_start": start_s, "wire": wire}


def dataset(tmp_path: Path, images: str) -> tuple[list[Path], Path, Path]:
    """(shards, tokenizer, index) of 237 usable demo photographs or of 40 document scans."""
    if images == "photographs":
        paths, index = indexed_demo(tmp_path, 240, 4, 2)
        return paths.shards, paths.tokenizer, index
    from demo_data import indexed_scans
    from packfeed.server.tools.demo import train_tokenizer

    tokenizer = train_tokenizer(tmp_path / "tokenizer.json")
    shards, index = indexed_scans(tmp_path / "scans", 40, tokenizer)
    return shards, tokenizer, index


ROUNDS = int(os.environ.get("PACKFEED_BENCH_ROUNDS", "5"))  # interleaved: the median and the spread are reported


@pytest.mark.parametrize("images", ["photographs", "scans"])
def test_cpu_per_delivered_sample(tmp_path, images):
    shards, tokenizer, index = dataset(tmp_path, images)
    pytest.importorskip("cv2")
    baseline_cpu_seconds(index, tokenizer)  # page cache and imports
    modes = ("exact", "fast", "encoded")
    ratios: dict[str, list[float]] = {pixels: [] for pixels in modes}
    for _ in range(ROUNDS):
        base_n, base_s = baseline_cpu_seconds(index, tokenizer)
        base = base_s / base_n
        print(f"\n[cpu/sample] {images}: InternVL's pre-processing: {base_n} samples, {base_s:.2f} CPU s = "
              f"{base * 1e3:.1f} ms per sample")
        wire = {}
        for pixels in modes:
            served = served_cpu_seconds(index, pixels)
            n, wire[pixels] = served["samples"], served["wire"]
            assert n == EPOCHS * base_n
            tree, workers, main = (served[part] / n for part in ("tree", "workers", "main"))
            ratios[pixels].append(base / tree)
            print(f"[cpu/sample] {images}: pixels {pixels}, {n} samples ({EPOCHS} epochs, 1 worker) from job open to "
                  f"the last byte: whole server tree {served['tree']:.2f} CPU s = {tree * 1e3:.1f} ms per sample, "
                  f"{base / tree:.1f}x less than the baseline; workers alone {workers * 1e3:.1f} ms "
                  f"({base / workers:.1f}x less); main process {main * 1e3:.1f} ms; once per server, start to idle: "
                  f"{served['server_start']:.2f} CPU s; wire {wire[pixels] / n / 1e6:.2f} MB per sample")
        print(f"[cpu/sample] {images}: wire bytes, uint8 tiles / encoded files: {wire['exact'] / wire['encoded']:.1f}x")
    print(f"[cpu/sample] {images}: whole tree from job open, {ROUNDS} rounds, times less than the baseline: " + ", ".join(
        f"{pixels} median {statistics.median(values):.2f}x (spread {min(values):.2f}-{max(values):.2f})"
        for pixels, values in ratios.items()))


def worker_cpu_seconds(index: Path, tokenizer: Path, pixels: str) -> tuple[int, float]:
    """(samples, CPU s) of the worker's own function over one epoch, in this process: read, decode, tile,
    tokenise, assemble, serialize, write to /dev/shm and map back; no gRPC, no other process."""
    from packfeed.server.serve import step_files, step_work, worker_process
    from packfeed.server.serve.datasets import Dataset
    from packfeed.server.serve.job_spec import JobSpec
    from packfeed.server.serve.registry import JobRegistry
    from packfeed.v1.layout import Seat
    from packfeed.v1.options import PlanConfig

    name = f"{index}:{pixels}"  # workers keep each dataset they opened under its name
    source = step_work.DatasetSource(str(index), str(tokenizer), pixels=pixels)
    worker_process.init_worker({name: source})
    job = JobRegistry({name: Dataset.open(name, source)}).open_job(JobSpec(f"inline-{pixels}", name,
                                                                           PlanConfig(dp=1, microbatches=2), 0))
    files = step_files.SharedFiles(step_files.shared_directory(), 1 << 30)  # reused step after step, as the server does
    samples, started = 0, time.process_time()
    for step in range(job.epoch_plan(0).n_steps):
        result = worker_process.build_rank_step(job.work(0, step, Seat(0)), files.take())
        result.files = files
        samples += result.attach().samples
        result.messages = []
    seconds = time.process_time() - started
    files.clear()
    step_files.remove_shared_files(step_files.shared_directory(), os.getpid())
    return samples, seconds


@pytest.mark.parametrize("images", ["photographs", "scans"])
def test_worker_function_against_the_baseline(tmp_path, images):
    """Where the serve tree's cost above the baseline lies: the worker function alone, in this process,
    interleaved with the baseline (the rest is the main process and running as separate processes)."""
    shards, tokenizer, index = dataset(tmp_path, images)
    pytest.importorskip("cv2")
    worker_cpu_seconds(index, tokenizer, "exact")  # imports, page cache, the tokenizer
    best = {name: float("inf") for name in ("baseline", "exact", "fast", "encoded")}
    for _ in range(ROUNDS):
        base_n, base_s = baseline_cpu_seconds(index, tokenizer)
        best["baseline"] = min(best["baseline"], base_s / base_n)
        line = [f"baseline {base_s / base_n * 1e3:.1f} ms"]
        for pixels in ("exact", "fast", "encoded"):
            n, seconds = worker_cpu_seconds(index, tokenizer, pixels)
            assert n == base_n
            best[pixels] = min(best[pixels], seconds / n)
            line.append(f"{pixels} {seconds / n * 1e3:.1f} ms ({seconds / n / (base_s / base_n):.2f}x)")
        print(f"\n[worker fn] {images}: " + ", ".join(line), end="")
    print(f"\n[worker fn] {images}: best of {ROUNDS}: " + ", ".join(
        f"{name} {seconds * 1e3:.1f} ms ({seconds / best['baseline']:.2f}x)" for name, seconds in best.items()))
