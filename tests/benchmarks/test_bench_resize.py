"""Candidates for a fast pixel path (measure and choose): decode + InternVL tiling (the grid resize
and the thumbnail) of the demo photographs per core, and each candidate's error against the exact path
(PIL bicubic, bit-identical to the HF processors): mean absolute error in 1/255 units and PSNR.

Candidates: PIL bicubic with `reducing_gap` (box-reduce by an integer factor first), JPEG DCT-domain
downscaling (`draft`) before the exact resize, both, and OpenCV (`INTER_AREA`, `INTER_CUBIC`) when installed.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_resize.py -m benchmark
"""

from __future__ import annotations

import io
import tarfile
import time

import numpy as np
import pytest
from PIL import Image

from packfeed.media.image_policy import InternVLTiling
from packfeed.media.pixels import to_rgb

from demo_data import document_scan
from packfeed.server.tools.demo import write_demo_dataset

pytestmark = pytest.mark.benchmark
POLICY = InternVLTiling()


def targets(width: int, height: int) -> list[tuple[int, int]]:
    cols, rows = POLICY.grid(width, height)
    size = POLICY.image_size
    return [(cols * size, rows * size)] + ([(size, size)] if cols * rows > 1 else [])


def pil(data: bytes, reducing_gap: float | None = None, draft: bool = False) -> list[np.ndarray]:
    with Image.open(io.BytesIO(data)) as image:
        full = image.size
        if draft and image.format == "JPEG":
            smallest = min(t[0] / full[0] for t in targets(*full)), min(t[1] / full[1] for t in targets(*full))
            image.draft("RGB", (int(full[0] * smallest[0] * 2), int(full[1] * smallest[1] * 2)))
        image = to_rgb(image)
        return [np.asarray(image.resize(t, Image.BICUBIC, reducing_gap=reducing_gap)) for t in targets(*full)]


def packfeed_exact(data: bytes) -> list[np.ndarray]:
    from packfeed.media.resample import resize_bicubic

    with Image.open(io.BytesIO(data)) as image:
        full = image.size
        pixels = np.asarray(to_rgb(image))
        return [resize_bicubic(pixels, t) for t in targets(*full)]


def opencv(data: bytes, interpolation: int) -> list[np.ndarray]:
    import cv2

    image = cv2.cvtColor(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    height, width = image.shape[:2]
    return [cv2.resize(image, t, interpolation=interpolation) for t in targets(width, height)]


def best_cpu_seconds(candidates: dict, inputs: list[bytes], rounds: int = 2) -> dict[str, float]:
    """Each candidate's CPU seconds over all inputs, best of interleaved rounds (the machine is noisy)."""
    timings: dict[str, float] = {}
    for _ in range(rounds):
        for name, fn in candidates.items():
            started = time.process_time()
            for data in inputs:
                fn(data)
            timings[name] = min(timings.get(name, float("inf")), time.process_time() - started)
    return timings


def error(candidate: list[np.ndarray], exact: list[np.ndarray]) -> tuple[float, float]:
    diff = np.concatenate([(c.astype(np.int16) - e.astype(np.int16)).ravel() for c, e in zip(candidate, exact)])
    mse = float(np.mean(diff.astype(np.float64) ** 2))
    return float(np.mean(np.abs(diff))), (10 * np.log10(255 ** 2 / mse) if mse else float("inf"))


def test_fast_resize_candidates(tmp_path):
    demo = write_demo_dataset(tmp_path / "demo", samples=160, shards=2, seed=5, bad_samples=False)
    images = []
    for shard in demo.shards:
        with tarfile.open(shard) as tar:
            images += [tar.extractfile(m).read() for m in tar if m.name.rsplit(".", 1)[-1] in ("jpg", "png")]
    exact = [pil(data) for data in images]
    candidates = {"PIL bicubic (exact)": pil, "Packfeed's bicubic (numba, the exact path)": packfeed_exact,
                  "PIL bicubic, reducing_gap 3": lambda d: pil(d, 3.0),
                  "JPEG draft + PIL bicubic": lambda d: pil(d, draft=True),
                  "JPEG draft + PIL reducing_gap 3": lambda d: pil(d, 3.0, draft=True)}
    try:
        import cv2

        cv2.setNumThreads(1)  # per core, like one worker
        candidates["OpenCV INTER_AREA"] = lambda d: opencv(d, cv2.INTER_AREA)
        candidates["OpenCV INTER_CUBIC"] = lambda d: opencv(d, cv2.INTER_CUBIC)
    except ImportError:
        pass
    print(f"\n[resize] {len(images)} demo images (JPEG and PNG, 160-1600 px), InternVL 448 px tiling, one core")
    timings = best_cpu_seconds(candidates, images)
    for name, fn in candidates.items():
        errors = [error(fn(data), e) for data, e in zip(images, exact)]
        mae = float(np.mean([e[0] for e in errors]))
        psnr = float(np.min([e[1] for e in errors]))
        print(f"[resize] {name}: {timings[name] / len(images) * 1e3:.1f} ms per image "
              f"({timings['PIL bicubic (exact)'] / timings[name]:.2f}x the exact path); mean abs error "
              f"{mae:.3f}/255, worst-image PSNR {psnr:.1f} dB")
    assert error(pil(images[0]), exact[0])[0] == 0
    assert all(error(packfeed_exact(data), e)[0] == 0 for data, e in zip(images, exact))


def test_document_scans_exact_and_fast(tmp_path):
    """Large pages shrink (InternVL picks a 3 x 4 grid of 448 px tiles for 1700 x 2200, plus a thumbnail; the
    fixed 336 px policy shrinks 5-6x): Pillow's bicubic against Packfeed's exact and fast paths as the server
    runs them (file_tiles: decode, draft where fast allows it, resize, cut), per core, with each one's error."""
    from packfeed.media.image_policy import policy_from_dict
    from packfeed.media.pixels import decode_tiles
    from packfeed.media.pixel_modes import file_tiles

    pytest.importorskip("cv2")
    pages = [document_scan(seed) for seed in range(12)]
    print(f"\n[scans] {len(pages)} pages 1700x2200 JPEG, {sum(map(len, pages)) / len(pages) / 1024:.0f} KiB each")
    for policy in (policy_from_dict({"name": "internvl"}), policy_from_dict({"name": "fixed"}),
                   policy_from_dict({"name": "fixed", "resize": "crop"})):
        geometry = policy.geometry(1700, 2200, 1)
        modes = {"Pillow": lambda d: decode_tiles(d, geometry), "exact": lambda d: file_tiles(d, geometry, "exact"),
                 "fast": lambda d: file_tiles(d, geometry, "fast")}
        exact = [modes["Pillow"](data) for data in pages]
        timings = best_cpu_seconds(modes, pages)
        for name, fn in modes.items():
            errors = [error([t.transpose(1, 2, 0) for t in fn(data)], [t.transpose(1, 2, 0) for t in e])
                      for data, e in zip(pages, exact)]
            print(f"[scans] {policy.name} {getattr(policy, 'resize', '')}: {name}: "
                  f"{timings[name] / len(pages) * 1e3:.1f} ms per page ({timings['Pillow'] / timings[name]:.2f}x "
                  f"Pillow); mean abs error {np.mean([e[0] for e in errors]):.3f}/255, worst PSNR "
                  f"{min(e[1] for e in errors):.1f} dB")
            if name == "exact":
                assert all(e[0] == 0 for e in errors)


def test_fast_path_error_per_policy(tmp_path):
    """`pixels: fast` against `exact` on the demo photographs, per image policy: mean and worst-image error."""
    from packfeed.media.image_policy import policy_from_dict
    from packfeed.media.pixel_modes import image_tiles

    pytest.importorskip("cv2")
    demo = write_demo_dataset(tmp_path / "demo", samples=160, shards=2, seed=5, bad_samples=False)
    images = []
    for shard in demo.shards:
        with tarfile.open(shard) as tar:
            for member in tar:
                if member.name.rsplit(".", 1)[-1] in ("jpg", "png"):
                    image = Image.open(io.BytesIO(tar.extractfile(member).read()))
                    image.load()
                    images.append(image)
    print(f"\n[fast error] {len(images)} demo photographs")
    for raw in ({"name": "internvl"}, {"name": "qwen2vl"}, {"name": "qwen2vl", "factor": 32, "patch_size": 16},
                {"name": "fixed"}, {"name": "fixed", "resize": "crop"},
                {"name": "internvl", "image_size": 112, "max_num": 4, "tokens_per_tile": 16}):
        policy = policy_from_dict(raw)
        errors = [error([t.transpose(1, 2, 0) for t in image_tiles(image, policy, 1, "fast")],
                        [t.transpose(1, 2, 0) for t in image_tiles(image, policy, 1, "exact")]) for image in images]
        maes, psnrs = [e[0] for e in errors], [min(e[1], 99.0) for e in errors]
        print(f"[fast error] {raw}: mean abs error {np.mean(maes):.3f}/255 (worst image {max(maes):.3f}), "
              f"mean PSNR {np.mean(psnrs):.1f} dB (worst image {min(psnrs):.1f})")
        assert max(maes) > 0


def test_fast_path_decoding(tmp_path):
    """Decoding alone, to uint8 (H, W, 3) upright RGB: Pillow as the exact path decodes (`to_rgb`, copied out of
    Pillow's 4-byte pixels), OpenCV's imdecode (the fast path's decoder before), and the fast path's `decode`
    (simplejpeg and pyspng where they decode as Pillow does), on the demo photographs at full size, with freed
    memory kept as a server process keeps it; the benchmark checks that all give the same pixels."""
    cv2 = pytest.importorskip("cv2")
    from packfeed.media.fast import decode as fast_pixels
    from packfeed.media.image_policy import policy_from_dict
    from packfeed.media.pixels import oriented_size
    from packfeed.server.serve.worker_process import keep_freed_memory

    keep_freed_memory()  # as a worker: large outputs come from kept memory, not fresh pages
    demo = write_demo_dataset(tmp_path / "demo", samples=160, shards=2, seed=5, bad_samples=False)
    images = []
    for shard in demo.shards:
        with tarfile.open(shard) as tar:
            images += [tar.extractfile(m).read() for m in tar if m.name.rsplit(".", 1)[-1] in ("jpg", "png")]
    policy = policy_from_dict({"name": "internvl"})  # targets over a quarter of the image: no draft
    geometries = [policy.geometry(*oriented_size(Image.open(io.BytesIO(data)), data), 1) for data in images]

    def pillow(data: bytes) -> np.ndarray:
        with Image.open(io.BytesIO(data)) as image:
            return np.asarray(to_rgb(image))

    def opencv(data: bytes) -> np.ndarray:
        flags = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION
        return cv2.imdecode(np.frombuffer(data, np.uint8), flags)

    assert all(np.array_equal(pillow(data), fast_pixels(data, g)) for data, g in zip(images, geometries))
    upright = [data for data in images if Image.open(io.BytesIO(data)).mode == "RGB"]
    assert all(np.array_equal(pillow(data), opencv(data)) for data in upright)
    geometry_of = {id(data): g for data, g in zip(images, geometries)}
    decoders = {"Pillow + to_rgb + copy out": pillow, "OpenCV imdecode": opencv,
                "fast_pixels": lambda data: fast_pixels(data, geometry_of[id(data)])}
    timings = best_cpu_seconds(decoders, images, rounds=3)
    for name, seconds in timings.items():
        print(f"\n[decode] {len(images)} demo images, {name}: {seconds / len(images) * 1e3:.2f} ms per image "
              f"({timings['Pillow + to_rgb + copy out'] / seconds:.2f}x)", end="")
    print()
