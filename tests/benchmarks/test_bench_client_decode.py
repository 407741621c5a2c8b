"""Client-side decoding of `pixels: encoded` packs: images and samples per second, and CPU per sample, of the
Pillow backend on 1 and 2 CPU threads and of the torchvision backend on the CPU (and on CUDA where there is a
GPU), over the same serialized packs, interleaved; on the demo photographs and on document scans.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_client_decode.py -m benchmark
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from demo_data import indexed_demo, indexed_scans

pytestmark = [pytest.mark.benchmark,
              pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities of TorchVision")]


def encoded_messages(index) -> list[bytes]:
    """Every sample of the index in packs of 4, as the server's workers serialize them with pixels: encoded."""
    from packfeed.server.serve.index_rows import IndexRows
    from packfeed.server.serve.packs import assemble_pack
    from packfeed.server.serve.preprocess import SampleReader, SampleSkipped
    from packfeed.server.serve.wire import encode_pack

    rows = IndexRows(index)
    reader = SampleReader(rows.info, rows.info.tokenizer["path"], pixels="encoded")
    samples = []
    for sample_id in range(len(rows.table)):
        try:
            samples.append(reader.load(rows.row(sample_id)))
        except SampleSkipped:
            continue
    return [encode_pack(assemble_pack(samples[i:i + 4], 0, 0, 0, 0), 1, False) for i in range(0, len(samples), 4)]


def decode_all(messages: list[bytes], options) -> tuple[float, float, int, int]:
    """(wall s, CPU s of this process, images, samples) to decode every pack."""
    from packfeed.client.stream.decode import PackDecoder
    from packfeed.client.stream.tensors import pack_of

    decoder = PackDecoder(options)
    packs = [pack_of(message) for message in messages]
    images = sum(len(p.image_sample) for p in packs)
    samples = sum(len(p.sample_keys) for p in packs)
    wall, cpu = time.perf_counter(), time.process_time()
    for step in range(0, len(packs), 2):  # steps of 2 packs (M = 2)
        assert not decoder.decode(packs[step:step + 2])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    decoder.close()
    return wall, cpu, images, samples


@pytest.mark.parametrize("images", ["photographs", "scans"])
def test_client_decode_throughput(tmp_path, images):
    from packfeed.client.stream.decode import DecodeOptions
    from packfeed.server.tools.demo import train_tokenizer

    if images == "photographs":
        index = indexed_demo(tmp_path, 120, 2, 2)[1]
    else:
        index = indexed_scans(tmp_path / "scans", 24, train_tokenizer(tmp_path / "tokenizer.json"))[1]
    messages = encoded_messages(index)
    backends = {"pil, 1 thread": DecodeOptions("pil", threads=1), "pil, 2 threads": DecodeOptions("pil", threads=2),
                "torchvision, cpu": DecodeOptions("torchvision", device="cpu", threads=1)}
    if torch.cuda.is_available():
        backends["torchvision, cuda (nvJPEG)"] = DecodeOptions("torchvision", device="cuda")
    decode_all(messages[:2], backends["pil, 1 thread"])  # imports, page cache
    best = {name: (float("inf"), 0.0, 0, 0) for name in backends}
    for _ in range(2):
        for name, options in backends.items():
            result = decode_all(messages, options)
            best[name] = min(best[name], result)
    print(f"\n[client decode] {images}: {len(messages)} packs")
    for name, (wall, cpu, n_images, n_samples) in best.items():
        print(f"[client decode] {images}: {name}: {n_images / wall:.0f} images/s, {n_samples / wall:.0f} samples/s, "
              f"{cpu / n_samples * 1e3:.1f} CPU ms per sample")
    assert all(np.isfinite(wall) and n_images > 0 for wall, _, n_images, _ in best.values())
