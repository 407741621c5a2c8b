"""`packfeed calibrate`: measure what each preprocessing feature (`packfeed.media.cpu_cost.FEATURES`) costs one
core of this machine, per pixel mode, and keep it (`~/.cache/packfeed/calibration/MACHINE.json`; PACKFEED_CACHE
moves it).

It prepares a fixed set of images made here (photograph-like and document-like, JPEG and PNG, 256 to 3,000 px on
the long side, tiled by InternVL's and Qwen2-VL's policies) the way a worker does, reading each file's checksum
too, tokenises text with a BPE tokenizer trained on the spot, and serves each image (and texts alone) as a
sample of a small indexed tar through the worker's own path (read, decode, tokenise through the chat template,
assemble, serialise: the worker's per-sample work beyond an image's); each item's CPU time (the median of several
rounds, this thread's CPU clock, so a loaded machine slows the wall clock but less the figure) is fitted by
non-negative least squares on its features. The fit's R^2 and Spearman rank correlation come with the model.
Videos are not measured yet: a video's frame pixel is taken at a PNG pixel's decode rate (said in the fit).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from packfeed.server import __version__
from packfeed.media.cpu_cost import FEATURES, CostModel, image_features
from packfeed.media.image_policy import policy_from_dict
from packfeed.media.pixel_modes import PIXEL_PATHS
from packfeed.v1.options import PixelMode

POLICIES = ({"name": "internvl"}, {"name": "qwen2vl"})
SIDES = (256, 512, 900, 1400, 2048, 3000)


def machine() -> dict[str, Any]:
    """What names this machine's figures: its CPU model, cores and Packfeed's version."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"host": platform.node(), "cpu": model, "cores": os.cpu_count(), "packfeed": __version__}


def calibration_path() -> Path:
    described = machine()
    key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(os.environ.get("PACKFEED_CACHE", Path.home() / ".cache" / "packfeed"))
    return root / "calibration" / f"{described['host'] or 'machine'}-{key}.json"


def calibration_images(sides: tuple[int, ...] = SIDES, seed: int = 0) -> list[tuple[bytes, str]]:
    """(file bytes, format) of the calibration set: per long side, a photograph-like and a document-like image,
    each as JPEG and as PNG, of a random aspect ratio."""
    rng = np.random.default_rng(seed)
    out = []
    for side in sides:
        for kind in ("photo", "document"):
            aspect = float(rng.uniform(0.5, 2.0))
            width, height = (side, max(16, int(side / aspect))) if aspect >= 1 else (max(16, int(side * aspect)), side)
            image = _photo(rng, width, height) if kind == "photo" else _document(rng, width, height)
            for fmt in ("JPEG", "PNG"):
                buffer = io.BytesIO()
                image.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {"compress_level": 1}))
                out.append((buffer.getvalue(), "jpeg" if fmt == "JPEG" else "png"))
    return out


def _photo(rng, width: int, height: int) -> Image.Image:
    coarse = rng.integers(0, 255, (max(2, height // 12), max(2, width // 12), 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.BICUBIC)


def _document(rng, width: int, height: int) -> Image.Image:
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    line = max(6, height // 40)
    for y in range(line, height - line, 2 * line):
        x = int(rng.integers(0, max(1, width // 10)))
        while x < width - line:
            word = int(rng.integers(line, 6 * line))
            draw.rectangle((x, y, min(width - 1, x + word), y + line // 2), fill=(20, 20, 20))
            x += word + line
    return image


def measure(mode: PixelMode, rounds: int = 3, sides: tuple[int, ...] = SIDES) -> tuple[np.ndarray, np.ndarray]:
    """(features, CPU seconds) of each calibration item in `mode`: every image under every policy, and texts of
    several lengths tokenised."""
    from packfeed.server.index.table import member_checksum

    path = PIXEL_PATHS[mode]
    path.check_available()
    rows, seconds = [], []
    for policy_spec in POLICIES:
        policy = policy_from_dict(policy_spec)
        for data, fmt in calibration_images(sides):
            with Image.open(io.BytesIO(data)) as image:
                geometry = policy.geometry(image.width, image.height, 1)

            def prepare():
                member_checksum(data)
                if not path.sends_files:
                    path.file_tiles(data, geometry, np.empty)

            features = image_features(fmt, len(data), geometry, mode)
            features[0] = 1
            rows.append(features)
            seconds.append(cpu_seconds(prepare, rounds))
    for features, run in _token_items():
        rows.append(features)
        seconds.append(cpu_seconds(run, rounds))
    served, served_seconds = served_items(mode, rounds, sides)
    return np.vstack([np.array(rows), served]), np.concatenate([np.array(seconds), served_seconds])


def served_items(mode: PixelMode, rounds: int, sides: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(features, CPU seconds) of samples prepared the way a worker prepares them, each alone in a pack: read at its
    offsets, checked, decoded and tiled, tokenised through the chat template, assembled and serialised. The set:
    every calibration image in a conversation of its own, and text-only conversations, in a tar indexed here with
    a tokenizer trained on the spot. This is where the worker's own per-sample work (beyond an image's) is
    measured."""
    import tarfile
    import tempfile

    from packfeed.media.chat import PRESETS
    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.cpu_features import sample_features
    from packfeed.server.index.indexer import build_index
    from packfeed.server.index.table import read_index_info
    from packfeed.server.serve.index_rows import IndexRows
    from packfeed.server.serve.packs import build_pack
    from packfeed.server.serve.preprocess import SampleReader
    from packfeed.server.serve.wire import encode_pack
    from packfeed.server.tools.demo import corpus_lines, train_tokenizer

    template = PRESETS["internvl"]
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        tokenizer = train_tokenizer(root / "tokenizer.json", vocab_size=2000, special_tokens=template.special_tokens)
        lines = corpus_lines()
        with tarfile.open(root / "calibration.tar", "w") as tar:
            samples = [(data, fmt) for data, fmt in calibration_images(sides)] + [(None, None)] * 8
            for k, (data, fmt) in enumerate(samples):
                answer = " ".join(lines[(k * 7 + j) % len(lines)] for j in range(1 + k % 5 * 8))
                doc = {"conversations": [{"from": "human", "value": ("<image>\n" if data else "") + lines[k % len(lines)]},
                                         {"from": "gpt", "value": answer}]}
                members = [(f"s{k:03d}.json", json.dumps(doc).encode())] + ([(f"s{k:03d}.{fmt[:3]}", data)] if data else [])
                for name, payload in members:
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
        index = root / "index.parquet"
        build_index([str(root / "calibration.tar")], index,
                    IndexConfig(str(tokenizer), {"name": "internvl"}, template.to_dict()), workers=1, progress=False)
        rows = IndexRows(index)
        reader = SampleReader(read_index_info(index), tokenizer, pixels=mode)
        parts = [(rows, reader, "calibration")]
        features = sample_features(index, [mode])[mode]
        one = np.zeros(1, np.int64)

        def prepare(sample_id: int):
            pack = build_pack(parts, np.array([sample_id]), one, one.astype(np.int32), 0, 0, 0, 0)
            encode_pack(pack, 1, False)

        valid = np.flatnonzero(features[:, 0] > 0)
        seconds = np.array([cpu_seconds(lambda k=k: prepare(int(k)), rounds) for k in valid])
        reader.close()
        return features[valid], seconds


def _token_items():
    """(features, a function tokenising a text of that many tokens) for texts of 100 to 20,000 tokens."""
    import tempfile

    from packfeed.server.tools.demo import corpus_lines, train_tokenizer
    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory() as folder:
        tokenizer = Tokenizer.from_file(str(train_tokenizer(Path(folder) / "tokenizer.json", vocab_size=2000)))
    corpus = " ".join(corpus_lines())
    for words in (100, 1000, 5000, 20000):
        text = " ".join((corpus.split() * (1 + words // max(1, len(corpus.split())))))[:words * 6]
        tokens = len(tokenizer.encode(text, add_special_tokens=False).ids)
        features = np.zeros(len(FEATURES))
        features[0], features[-1] = 1, tokens
        yield features, (lambda text=text: tokenizer.encode_batch([text], add_special_tokens=False))


def cpu_seconds(run, rounds: int = 3) -> float:
    """This thread's CPU seconds of `run()`, the median of `rounds` after one warm-up call."""
    run()  # warm: first-call imports and caches are not the steady cost
    times = []
    for _ in range(rounds):
        started = time.thread_time()
        run()
        times.append(time.thread_time() - started)
    return float(np.median(times))


def fit(mode: PixelMode, features: np.ndarray, seconds: np.ndarray) -> CostModel:
    """The non-negative least-squares model of `seconds` on `features` (each item weighted by 1/seconds, so a
    small image's error counts as much as a large one's), with its R^2 and Spearman correlation."""
    from scipy.optimize import nnls
    from scipy.stats import spearmanr

    used = features.any(axis=0)
    weights = 1.0 / np.maximum(seconds, 1e-6)
    solved, _ = nnls(features[:, used] * weights[:, None], seconds * weights)
    coefficients = np.zeros(len(FEATURES))
    coefficients[used] = solved
    notes = {}
    if mode != PixelMode.ENCODED:
        coefficients[FEATURES.index("video_pixels")] = coefficients[FEATURES.index("png_pixels")]
        notes["video"] = "not measured: a video frame pixel at a PNG pixel's rate"
    predicted = features @ coefficients
    r2 = 1 - float(((seconds - predicted) ** 2).sum() / max(((seconds - seconds.mean()) ** 2).sum(), 1e-30))
    return CostModel(mode, tuple(float(c) for c in coefficients),
                     {"r2": round(r2, 4), "spearman": round(float(spearmanr(predicted, seconds).statistic), 4),
                      "items": int(len(seconds)), **notes}, machine())


def calibrate(modes: list[PixelMode], rounds: int = 3, sides: tuple[int, ...] = SIDES,
              save: bool = True) -> dict[str, CostModel]:
    """Measure and fit each mode (a mode whose libraries are missing is left out, said in the error); kept for
    this machine with `save`."""
    models = {mode.value: fit(mode, *measure(mode, rounds, sides)) for mode in modes}
    if save:
        path = calibration_path()
        kept = _read(path)
        kept.update({name: model.to_dict() for name, model in models.items()})
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(kept, indent=1))
        os.replace(partial, path)
    return models


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def cost_model(mode: PixelMode, measure_if_missing: bool = True) -> CostModel | None:
    """This machine's model for `mode`: as kept, else measured now (quickly, and kept) with
    `measure_if_missing`, else None."""
    kept = _read(calibration_path()).get(mode.value)
    if kept is not None:
        return CostModel.from_dict(kept)
    if not measure_if_missing:
        return None
    return calibrate([mode], rounds=3, sides=SIDES[:4])[mode.value]
