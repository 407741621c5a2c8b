"""Conversion throughput: `packfeed convert llava` over an image folder of real photographs (the demo's,
160-1600 px, JPEG and PNG) and a LLaVA JSON, in samples/s per core, against reading and fully decoding the
same images with PIL in the same run (the floor of any converter that checks its images).

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_convert.py -m benchmark
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path

import pytest
from PIL import Image

from packfeed.server.convert.convert import ConvertOptions, convert
from packfeed.server.tools.demo import write_demo_dataset

pytestmark = pytest.mark.benchmark


def llava_source(root: Path, samples: int) -> tuple[Path, Path, list[Path]]:
    """The demo dataset unpacked into an image folder and a LLaVA JSON list."""
    demo = write_demo_dataset(root / "demo", samples=samples, shards=4, seed=4, bad_samples=False)
    images, entries, files = root / "images", [], []
    images.mkdir()
    for shard in demo.shards:
        with tarfile.open(shard) as tar:
            members: dict[str, dict[str, bytes]] = {}
            for member in tar:
                key, suffix = member.name.split(".", 1)
                members.setdefault(key, {})[suffix] = tar.extractfile(member).read()
        for key, sample in members.items():
            names = []
            for suffix in sorted(s for s in sample if s != "json"):
                path = images / f"{key}.{suffix}"
                path.write_bytes(sample[suffix])
                names.append(path.name)
                files.append(path)
            entry = {"id": key, "conversations": json.loads(sample["json"])["conversations"]}
            if names:
                entry["images"] = names
            entries.append(entry)
    annotation = root / "llava.json"
    annotation.write_text(json.dumps(entries))
    return annotation, images, files


def test_conversion_samples_per_core(tmp_path):
    annotation, images, files = llava_source(tmp_path, 600)
    rows = len(json.loads(annotation.read_text()))

    started = time.process_time()
    for path in files:
        with Image.open(io.BytesIO(path.read_bytes())) as image:
            image.load()
    decode_s = time.process_time() - started
    print(f"\n[convert] {rows} samples, {len(files)} images, "
          f"{sum(p.stat().st_size for p in files) / 2**20:.0f} MiB")
    print(f"[convert] baseline, read + full PIL decode of every image: {rows / decode_s:.0f} samples/s per core")

    reports = {}
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        convert(ConvertOptions("llava", str(annotation), str(out), str(images), workers=workers, progress=False))
        out2 = tmp_path / f"out{workers}-timed"
        report = convert(ConvertOptions("llava", str(annotation), str(out2), str(images), workers=workers,
                                         progress=False))
        reports[workers] = report
        print(f"[convert] packfeed convert, {workers} worker(s): {report.seconds:.2f} s wall = "
              f"{report.samples_per_second:.0f} samples/s; {report.samples_per_second_per_core:.0f} samples/s "
              f"per core (worker CPU time {report.core_seconds:.2f} s); {len(report.shards)} shard(s)")
        assert report.converted == rows and report.rejected == 0
    same = [p.read_bytes() for p in sorted((tmp_path / "out1").glob("*.tar"))] == \
        [p.read_bytes() for p in sorted((tmp_path / "out2").glob("*.tar"))]
    print(f"[convert] shards identical for 1 and 2 workers: {same}")
    assert same
