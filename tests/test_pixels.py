"""Pixel modes per dataset: `exact` (PIL bicubic, as the HF processors) and `fast` (media/fast.py), chosen in the
server config and shown in JobInfo; the fast path stays within its stated error of the exact one on every
demo photograph, for every image policy."""

from __future__ import annotations

import io

import numpy as np
import pytest
import yaml
from PIL import Image

from demo_data import PRESET_POLICIES, demo_image_files, document_scan
from packfeed.media.image_policy import policy_from_dict
from packfeed.media.pixels import decode_tiles, pil_resizer
from packfeed.media.pixel_modes import image_tiles

def demo_images(demo_dataset) -> list[Image.Image]:
    images = [Image.open(io.BytesIO(data)) for data in demo_image_files(demo_dataset)]
    for image in images:
        image.load()
    return images


# The presets' resolutions; much smaller tiles (e.g. 112 px) shrink photographs more than the bound holds for
# (BENCHMARKS.md: mean abs error 1.013/255 there).
@pytest.mark.parametrize("policy", PRESET_POLICIES, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_fast_tiles_stay_within_their_bound_of_exact(demo_dataset, policy):
    """Mean absolute error under 1/255 and PSNR above 40 dB over the demo photographs (the bound documented
    for `pixels: fast`); every tile has the exact path's shape."""
    policy = policy_from_dict(policy)
    errors, psnrs = [], []
    for image in demo_images(demo_dataset):
        exact, fast = image_tiles(image, policy, 1, "exact"), image_tiles(image, policy, 1, "fast")
        assert [t.shape for t in fast] == [t.shape for t in exact]
        diff = np.concatenate([(f.astype(np.int16) - e.astype(np.int16)).ravel() for f, e in zip(fast, exact)])
        mse = float(np.mean(diff.astype(np.float64) ** 2))
        errors.append(float(np.mean(np.abs(diff))))
        psnrs.append(10 * np.log10(255 ** 2 / mse) if mse else 99.0)
    assert len(errors) > 20
    assert np.mean(errors) < 1.0 and np.mean(psnrs) > 40
    assert max(errors) > 0  # it is another resampler, not the exact path again


@pytest.mark.parametrize("policy", PRESET_POLICIES, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_fast_tiles_of_document_scans_stay_within_their_bound(policy):
    """Text pages, decoded as the server decodes them (JPEG draft where every target is at most half the page):
    shrinking stays exact, so the fast path keeps its bound on sharp edges too."""
    from packfeed.media.pixel_modes import file_tiles

    policy = policy_from_dict(policy)
    errors, psnrs = [], []
    for seed in range(3):
        data = document_scan(seed)
        geometry = policy.geometry(1700, 2200, 1)
        exact = decode_tiles(data, geometry, pil_resizer)
        fast = file_tiles(data, geometry, "fast")
        assert [t.shape for t in fast] == [t.shape for t in exact]
        diff = np.concatenate([(f.astype(np.int16) - e.astype(np.int16)).ravel() for f, e in zip(fast, exact)])
        mse = float(np.mean(diff.astype(np.float64) ** 2))
        errors.append(float(np.mean(np.abs(diff))))
        psnrs.append(10 * np.log10(255 ** 2 / mse) if mse else 99.0)
    assert np.mean(errors) < 1.0 and np.mean(psnrs) > 40, (errors, psnrs)


def test_a_dataset_is_served_with_the_pixels_its_config_names(tmp_path, small_tile_index):
    import grpc

    from packfeed.client import LocalServer, PackStream
    from packfeed.v1 import packfeed_pb2 as pb
    from packfeed.v1 import packfeed_pb2_grpc as pb_grpc

    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump({"datasets": {"exact": {"index": str(small_tile_index)},
                                                   "fast": {"index": str(small_tile_index), "pixels": "fast"}}}))
    tiles = {}
    with LocalServer(config=config, workers=1) as server:
        for name in ("exact", "fast"):
            with PackStream(server.target, job=name, dataset=name, rank=0, dp=1, microbatches=1) as stream:
                pack = next(iter(stream)).packs[0]
                tiles[name] = (pack.sample_keys, [t.clone() for t in pack.tiles()])
            info = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target)).GetJob(pb.GetJobRequest(job=name))
            assert info.pixels == name
    assert tiles["exact"][0] == tiles["fast"][0]  # the same plan, the same samples
    exact, fast = tiles["exact"][1], tiles["fast"][1]
    assert [t.shape for t in exact] == [t.shape for t in fast] and exact
    difference = np.mean([np.abs(e.numpy().astype(int) - f.numpy().astype(int)).mean() for e, f in zip(exact, fast)])
    assert 0 < difference < 3.0  # 112 px tiles: the fast path's bound is stated for the presets' sizes


def test_unknown_pixel_modes_are_refused(tmp_path, small_tile_index):
    from packfeed.server.serve.config import load_config

    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump({"datasets": {"d": {"index": str(small_tile_index), "pixels": "lossy"}}}))
    with pytest.raises(ValueError, match="pixels must be one of exact, fast, encoded, not 'lossy'"):
        load_config(config, environ={})


def test_a_dataset_named_twice_in_the_server_config_is_refused(tmp_path, small_tile_index):
    """Plain YAML keeps the last of two equal keys silently: the server's config refuses it, naming the file."""
    from packfeed.server.serve.config import load_config

    config = tmp_path / "server.yaml"
    config.write_text(f"datasets:\n  d:\n    index: {small_tile_index}\n  d:\n    index: {small_tile_index}\n")
    with pytest.raises(ValueError, match=f"server config {config}: .*key 'd' is given twice"):
        load_config(config, environ={})


def test_fast_path_decodes_large_jpegs_at_reduced_scale_within_its_bound(demo_dataset):
    """A photograph at least 4x the size of every target is decoded at 1/2..1/8 scale (JPEG draft: the pixels of
    Pillow's draft); the tiles stay within the fast bound of exact, and a target too large for it keeps the full
    decode."""
    from packfeed.media.fast import decode as fast_pixels, draft_scale
    from packfeed.media.pixel_modes import file_tiles

    policy = policy_from_dict({"name": "fixed"})  # 336 px squares
    errors, psnrs = [], []
    for image in demo_images(demo_dataset)[:12]:
        buffer = io.BytesIO()
        scale = max(2, -(-1400 // min(image.size)))  # both sides at least 4x 336
        image.convert("RGB").resize((image.width * scale, image.height * scale), Image.BICUBIC).save(buffer, "JPEG",
                                                                                                     quality=92)
        data = buffer.getvalue()
        width, height = image.width * scale, image.height * scale
        geometry = policy.geometry(width, height, 1)
        reduced = draft_scale(geometry)
        drafted = Image.open(io.BytesIO(data))
        drafted.draft("RGB", (width // reduced, height // reduced))
        assert reduced >= 2 and np.array_equal(fast_pixels(data, geometry), np.asarray(drafted.convert("RGB")))
        assert drafted.size == (-(-width // reduced), -(-height // reduced))
        fast, exact = file_tiles(data, geometry, "fast"), decode_tiles(data, geometry, pil_resizer)
        diff = (fast[0].astype(np.int16) - exact[0].astype(np.int16)).astype(np.float64)
        errors.append(np.abs(diff).mean())
        psnrs.append(10 * np.log10(255 ** 2 / max((diff ** 2).mean(), 1e-9)))
    assert np.mean(errors) < 1.0 and np.mean(psnrs) > 40
    geometry = policy_from_dict({"name": "internvl"}).geometry(width, height, 1)  # a target over a quarter
    assert draft_scale(geometry) == 1 and fast_pixels(data, geometry).shape == (height, width, 3)


def _encoded(image: Image.Image, format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format, **options)
    return buffer.getvalue()


def test_fast_decoding_gives_pillows_pixels_whichever_decoder_runs(demo_dataset):
    """The fast path decodes with simplejpeg and pyspng what they decode as Pillow does (8-bit RGB and grey JPEGs
    and PNGs, upright, whole), and leaves the rest to Pillow: both give what the exact path decodes, pixel for pixel; a
    truncated file fails as it does with Pillow."""
    from packfeed.media.fast import decode as fast_pixels, decodes_as_pillow
    from packfeed.media.pixels import oriented_size, to_rgb

    photo = Image.fromarray(np.asarray(demo_images(demo_dataset)[0].convert("RGB")))  # no info carried over
    exif = Image.Exif()
    exif[0x0112] = 6  # turned: the fast decoders do not apply it
    rgba = photo.convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(photo.size))
    wide = Image.fromarray((np.asarray(photo.convert("L"), dtype=np.uint16) * 257).astype(np.uint16))
    files = {"jpeg": (_encoded(photo, "JPEG", quality=90), True),
             "progressive jpeg": (_encoded(photo, "JPEG", progressive=True), True),
             "grey jpeg": (_encoded(photo.convert("L"), "JPEG"), True),
             "png": (_encoded(photo, "PNG"), True),
             "grey png": (_encoded(photo.convert("L"), "PNG"), True),
             "turned jpeg": (_encoded(photo, "JPEG", exif=exif), False),
             "cmyk jpeg": (_encoded(photo.convert("CMYK"), "JPEG"), False),
             "rgba png": (_encoded(rgba, "PNG"), False),
             "palette png with transparency": (_encoded(photo.convert("P"), "PNG", transparency=0), False),
             "16-bit png": (_encoded(wide, "PNG"), False),
             "jpeg with bytes after its end": (_encoded(photo, "JPEG") + b"\0" * 16, False)}
    policy = policy_from_dict({"name": "internvl"})
    for name, (data, by_fast_decoders) in files.items():
        with Image.open(io.BytesIO(data)) as image:
            geometry = policy.geometry(*oriented_size(image, data), 1)
            assert decodes_as_pillow(image, data) == by_fast_decoders, name
            image.load()
            expected = np.asarray(to_rgb(image))
        assert np.array_equal(fast_pixels(data, geometry), expected), name
    truncated = files["jpeg"][0][:len(files["jpeg"][0]) // 2]
    with pytest.raises(OSError, match="truncated"):
        fast_pixels(truncated, policy.geometry(*photo.size, 1))


# (width, height) -> target: both shrink, one shrinks as the other grows (both ways), one side kept, a shrink
# large enough to box-average first, and enlarging
_FAST_SHAPES = [((300, 200), (130, 90)), ((300, 200), (130, 260)), ((200, 300), (260, 130)), ((300, 200), (130, 200)),
                ((300, 200), (300, 70)), ((900, 700), (100, 80)), ((90, 60), (200, 150)), ((301, 7), (5, 3))]


@pytest.mark.parametrize("shape", _FAST_SHAPES, ids=lambda s: f"{s[0][0]}x{s[0][1]}-{s[1][0]}x{s[1][1]}")
def test_fast_tiles_on_colour_planes_equal_the_kernels_on_interleaved_pixels(shape):
    """The fast path shrinks the interleaved pixels (the horizontal pass between OpenCV's transposes): the
    same bytes as `packfeed.media.resample`'s kernels on the interleaved image, the height first (box-averaged
    first by OpenCV where the target is at most a quarter of it), and OpenCV's bicubic where it enlarges."""
    cv2 = pytest.importorskip("cv2")
    from packfeed.media import fast
    from packfeed.media.chw import chw_tiles
    from packfeed.media.pixels import Geometry
    from packfeed.media.resample import resize_bicubic

    (width, height), (out_width, out_height) = shape
    pixels = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)

    def interleaved(size: tuple[int, int]) -> np.ndarray:
        if size[0] >= width and size[1] >= height:
            return cv2.resize(pixels, size, interpolation=cv2.INTER_CUBIC)
        factor = min(width // size[0], height // size[1]) // 2
        reduced = cv2.resize(pixels, (-(-width // factor), -(-height // factor)), interpolation=cv2.INTER_AREA) \
            if factor >= 2 else pixels
        return resize_bicubic(reduced, size, pillow_order=False)

    half = out_width // 2
    geometry = Geometry(width, height, out_width, out_height, half, 0, out_width - half, out_height, 0, 17)
    expected = chw_tiles(interleaved((out_width, out_height)), geometry.boxes()) + \
        chw_tiles(interleaved((17, 17)), [(0, 0, 17, 17)])
    tiles = fast.tiles(pixels, geometry)
    assert [t.shape for t in tiles] == [t.shape for t in expected]
    assert all(np.array_equal(t, e) for t, e in zip(tiles, expected))
