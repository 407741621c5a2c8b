"""What aligning tensor payloads costs: encoding real packs with every payload at a multiple of 64 bytes of
the message (the default) against no padding, interleaved in one run, and the bytes it adds.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_alignment.py -m benchmark
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from packfeed.client.stream.wire import split_pack
from packfeed.server.serve.packs import Pack
from packfeed.server.serve.wire import ALIGNMENT, encode_pack
from packfeed.v1 import packfeed_pb2 as pb
from test_bench_serve import demo, packfeed_preprocess  # noqa: F401  (the module's dataset fixture)

pytestmark = pytest.mark.benchmark


def as_pack(message: bytes) -> Pack:
    parsed = pb.Pack.FromString(message)
    tensors = {name: np.frombuffer(t.data, dtype=np.dtype(t.dtype).newbyteorder("<")).reshape(tuple(t.shape))
               for name, t in parsed.tensors.items()}
    return Pack(parsed.epoch, parsed.step, parsed.rank, parsed.microbatch, list(parsed.sample_keys), tensors,
                parsed.loss_tokens, [(s.key, s.reason) for s in parsed.skipped], parsed.step_loss_tokens)


def test_aligned_payloads_cost_no_throughput(demo):  # noqa: F811
    _, index = demo
    packs = [as_pack(m) for m in packfeed_preprocess(index, keep=32)[2]]
    payload = sum(array.nbytes for pack in packs for array in pack.tensors.values())
    times = {ALIGNMENT: [], 1: []}
    for _ in range(5):
        for alignment in ((ALIGNMENT, 1) if _ % 2 else (1, ALIGNMENT)):
            started = time.perf_counter()
            messages = [encode_pack(pack, 2, False, alignment) for pack in packs]
            times[alignment].append(time.perf_counter() - started)
            if alignment == ALIGNMENT:
                aligned_bytes = sum(len(m) for m in messages)
                offsets = [w.offset for m in messages for w in split_pack(m)[1].values() if w.nbytes]
                assert all(offset % ALIGNMENT == 0 for offset in offsets)
            else:
                plain_bytes = sum(len(m) for m in messages)
    best = {a: min(t) for a, t in times.items()}
    print(f"\n[alignment] {len(packs)} real packs, {payload / 1e6:.1f} MB of payload, best of 5 (interleaved): "
          f"encode aligned {payload / best[ALIGNMENT] / 1e9:.2f} GB/s, unaligned {payload / best[1] / 1e9:.2f} GB/s "
          f"(ratio {best[1] / best[ALIGNMENT]:.3f}); padding adds {aligned_bytes - plain_bytes} bytes "
          f"({(aligned_bytes - plain_bytes) / plain_bytes * 100:.4f}%)")
