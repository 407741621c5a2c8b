"""Each sample's preprocessing cost (issue [6/6]): the model calibrated on this machine (`packfeed calibrate`, its
own synthetic images) ranks other, real images (scikit-image's photographs and rendered text pages, cropped and
scaled from 160 to 2,400 px, JPEG and PNG) by their measured CPU in `exact` and `fast` (Spearman >= 0.9), and
`packfeed stats --gpus N --step-seconds S` sizes the loader cores per GPU from it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image, ImageDraw
from scipy.stats import spearmanr

from packfeed.media.cpu_cost import image_features
from packfeed.media.image_policy import policy_from_dict
from packfeed.media.pixel_modes import PIXEL_PATHS
from packfeed.server.tools.calibrate import cpu_seconds
from packfeed.v1.options import PixelMode

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """This machine's models, kept in a folder of the test's own."""
    from packfeed.server.tools.calibrate import SIDES, calibrate

    folder = tmp_path_factory.mktemp("cache")
    previous = os.environ.get("PACKFEED_CACHE")
    os.environ["PACKFEED_CACHE"] = str(folder)
    try:
        yield calibrate([PixelMode.EXACT, PixelMode.FAST], rounds=3, sides=SIDES[:5]), folder
    finally:
        os.environ.pop("PACKFEED_CACHE") if previous is None else os.environ.__setitem__("PACKFEED_CACHE", previous)


def real_images() -> list[tuple[bytes, str]]:
    """Photographs (scikit-image's) and text pages rendered with a real font, at many sizes and both formats."""
    from packfeed.server.tools.demo import _load_photos

    rng = np.random.default_rng(3)
    photos = _load_photos()
    out = []
    for k, side in enumerate((160, 300, 448, 700, 1000, 1400, 1900, 2400)):
        photo = photos[k % len(photos)]
        scale = side / max(photo.size)
        image = photo.resize((max(16, int(photo.width * scale)), max(16, int(photo.height * scale))), Image.BICUBIC)
        page = Image.new("RGB", (side, int(side * 1.3)), "white")
        draw = ImageDraw.Draw(page)
        for y in range(8, page.height - 16, 14):
            draw.text((8, y), " ".join(str(int(v)) * 3 for v in rng.integers(0, 999, 40)), fill="black")
        for picture, fmt in ((image, "JPEG"), (page, "PNG"), (image, "PNG") if side <= 1000 else (page, "JPEG")):
            buffer = io.BytesIO()
            picture.save(buffer, format=fmt, **({"quality": 88} if fmt == "JPEG" else {}))
            out.append((buffer.getvalue(), "jpeg" if fmt == "JPEG" else "png"))
    return out


@pytest.mark.parametrize("mode", [PixelMode.EXACT, PixelMode.FAST])
def test_the_cost_model_ranks_real_images_by_their_measured_cpu(calibrated, mode):
    models, _ = calibrated
    model = models[mode.value]
    assert model.fit["spearman"] >= 0.9 and model.fit["r2"] > 0.5, model.fit  # its own set, explained
    policy = policy_from_dict({"name": "internvl"})
    predicted, measured = [], []
    for data, fmt in real_images():
        with Image.open(io.BytesIO(data)) as image:
            geometry = policy.geometry(image.width, image.height, 1)
        features = image_features(fmt, len(data), geometry, mode)
        features[0] = 1
        predicted.append(float(model.seconds_of(features[None])[0]))
        measured.append(cpu_seconds(lambda: PIXEL_PATHS[mode].file_tiles(data, geometry, np.empty)))
    rho = spearmanr(predicted, measured).statistic
    assert rho >= 0.9, (rho, list(zip(predicted, measured)))


def test_stats_sizes_the_loader_cores_per_gpu(calibrated, tmp_path):
    from group_data import index_annotations
    from recipe_data import write_image

    _, cache = calibrated
    rng = np.random.default_rng(1)
    rows = []
    for k in range(12):
        write_image(tmp_path / "images" / f"{k}.jpg", rng)
        rows.append({"id": f"s{k}", "images": [f"{k}.jpg"], "conversations": [
            {"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A picture. " * (k + 1)}]})
    index = index_annotations(tmp_path, rows, {"name": "internvl", "max_num": 6})
    done = subprocess.run([sys.executable, "-m", "packfeed.cli", "stats", "--index", str(index), "--gpus", "4",
                           "--step-seconds", "0.5", "--out", str(tmp_path / "report")], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PACKFEED_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    report = json.loads((tmp_path / "report" / "report.json").read_text())["loader_cores"]
    assert printed["cores_per_gpu"] == report["cores_per_gpu"] and set(report["cores_per_gpu"]) >= {"exact", "fast"}
    for mode, row in report["by_pixels"].items():  # cores = samples per GPU-step x mean seconds / step seconds
        expected = report["samples_per_gpu_step"] * row["ms_per_sample"]["mean"] / 1e3 / 0.5
        assert row["cores_per_gpu"] == pytest.approx(expected, rel=0.02, abs=2e-3), mode
        assert row["memory_per_gpu_mb"] > 0
    assert report["by_pixels"]["fast"]["ms_per_sample"]["mean"] < report["by_pixels"]["exact"]["ms_per_sample"]["mean"]
    assert "Loader cores per GPU" in (tmp_path / "report" / "report.md").read_text()
