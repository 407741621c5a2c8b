"""What a server delivers is what was indexed, or it says so: member checksums, images converted as
`transformers` loads them, paths that survive a move, text that cannot forge template tokens, shards that
change under a running server. Real tar shards, real images, real `packfeed index` and `packfeed serve`."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from PIL import Image

from packfeed.client import LocalServer, PackStream
from packfeed.media.chat import ChatTemplate, load_tokenizer
from packfeed.media.pixels import oriented_size, to_rgb
from packfeed.server.index.config import IndexConfig
from packfeed.server.index.indexer import build_index
from packfeed.server.index.table import read_index_info
from packfeed.server.serve.index_rows import IndexRows
from packfeed.server.serve.preprocess import SampleReader, SampleSkipped

CLI = [sys.executable, "-m", "packfeed.cli"]


def conversation(question: str, answer: str) -> bytes:
    return json.dumps({"conversations": [{"from": "human", "value": question},
                                         {"from": "gpt", "value": answer}]}).encode()


def bmp(color: tuple[int, int, int], size=(64, 48)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="BMP")  # uncompressed: same size for any colour
    return buffer.getvalue()


def png(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", **options)
    return buffer.getvalue()


def write_tar(path, samples) -> None:
    with wds.TarWriter(str(path)) as writer:
        for sample in samples:
            writer.write(sample)


def index(shards, out, tokenizer, **config) -> pq.ParquetFile:
    build_index([str(s) for s in shards], out, IndexConfig(tokenizer=str(tokenizer), **config), workers=1,
                progress=False)
    return out


def every_sample(index_path, env=None, **plan) -> tuple[dict[str, object], list[tuple[str, str]]]:
    """{key: PackTensors holding it} and the skipped (key, reason) of one epoch at DP 1, from a real server."""
    packs, skipped = {}, []
    with LocalServer(index_path, workers=1, env=env) as server, \
            PackStream(server.target, job="integrity", rank=0, dp=1, **plan) as stream:
        for step in stream:
            for pack in step.packs:
                packs.update({key: pack for key in pack.sample_keys})
                skipped += pack.skipped
    return packs, skipped


def test_a_shard_rewritten_with_two_samples_swapped_is_caught(tmp_path, demo_dataset):
    """Same size, same layout, same token counts: only the content checksums can tell s1 now holds s2."""
    s1 = {"__key__": "s1", "bmp": bmp((250, 10, 10)), "json": conversation("<image>\nColour?", "It is red.")}
    s2 = {"__key__": "s2", "bmp": bmp((10, 10, 250)), "json": conversation("<image>\nColour?", "It is blu.")}
    shard = tmp_path / "swap.tar"
    write_tar(shard, [s1, s2])
    path = index([shard], tmp_path / "index.parquet", demo_dataset.tokenizer)
    packs, skipped = every_sample(path)
    assert set(packs) == {"s1", "s2"} and not skipped
    write_tar(shard, [{**s2, "__key__": "s1"}, {**s1, "__key__": "s2"}])
    with pytest.raises(Exception, match=r"FAILED_PRECONDITION: .* 2 of 2 samples skipped .*shard changed"):
        every_sample(path)  # by default a step that lost most of its samples fails loudly
    packs, skipped = every_sample(path, env={"PACKFEED_MAX_SKIPPED_FRACTION": "1"})
    assert not packs
    assert sorted(key for key, _ in skipped) == ["s1", "s2"]
    assert all(reason.startswith("shard changed") and "checksum" in reason for _, reason in skipped)


def test_images_convert_as_transformers_loads_them():
    gradient = (np.arange(256 * 64, dtype=np.uint32).reshape(64, 256) * 4).astype(np.uint16)  # 0..65532
    deep = Image.open(io.BytesIO(png(Image.fromarray(gradient))))
    assert deep.mode.startswith("I")
    converted = np.asarray(to_rgb(deep))
    assert converted.dtype == np.uint8 and converted.shape == (64, 256, 3)
    assert abs(converted.mean() - 127.5) < 1 and converted.min() == 0 and converted.max() == 255
    rgba = Image.new("RGBA", (10, 10), (255, 0, 0, 255))
    rgba.paste((0, 0, 0, 0), (0, 0, 5, 10))  # left half fully transparent
    composited = np.asarray(to_rgb(Image.open(io.BytesIO(png(rgba)))))
    assert (composited[:, :5] == 255).all() and (composited[:, 5:] == (255, 0, 0)).all()
    upright = Image.new("RGB", (40, 20), (0, 0, 0))
    upright.paste((255, 255, 255), (0, 0, 20, 20))  # left half white
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: a viewer turns it 90 degrees clockwise
    stored = Image.open(io.BytesIO(png(upright.transpose(Image.Transpose.ROTATE_90), exif=exif)))
    assert stored.size == (20, 40) and oriented_size(stored) == (40, 20)
    turned = np.asarray(to_rgb(stored))
    assert turned.shape == (20, 40, 3) and (turned[:, :20] == 255).all() and (turned[:, 20:] == 0).all()


def test_exif_rotated_images_are_costed_and_served_upright(tmp_path, demo_dataset):
    exif = Image.Exif()
    exif[0x0112] = 8
    tall = Image.new("RGB", (300, 1200), (40, 200, 40))  # stored tall, shown wide: 1200 x 300
    sample = {"__key__": "turned", "png": png(tall, exif=exif), "json": conversation("<image>\nWhat?", "Green.")}
    write_tar(tmp_path / "exif.tar", [sample])
    path = index([tmp_path / "exif.tar"], tmp_path / "index.parquet", demo_dataset.tokenizer,
                 image_policy={"name": "internvl", "image_size": 112, "tokens_per_tile": 16, "max_num": 4})
    row = pq.read_table(path).to_pylist()[0]
    assert (row["image_widths"], row["image_heights"]) == ([1200], [300])
    packs, skipped = every_sample(path)
    assert not skipped
    shapes = packs["turned"].tile_shapes.tolist()
    assert len(shapes) == 5  # a 4 x 1 grid of the wide picture + thumbnail, not 1 x 4
    assert row["vision_units"] == len(shapes)


def test_relative_shard_paths_serve_from_any_directory(tmp_path, demo_dataset):
    data = tmp_path / "data"
    data.mkdir()
    write_tar(data / "rel.tar", [{"__key__": "k", "json": conversation("Why?", "Because.")}])
    subprocess.run(CLI + ["index", "rel.tar", "--tokenizer", str(demo_dataset.tokenizer), "--out", "index.parquet",
                          "--quiet"], cwd=data, check=True, capture_output=True)
    assert read_index_info(data / "index.parquet").inputs == [str(data / "rel.tar")]
    packs, skipped = every_sample(data / "index.parquet")  # the server runs in the test's directory
    assert set(packs) == {"k"} and not skipped


def test_text_cannot_forge_template_tokens(tmp_path, demo_dataset):
    template = ChatTemplate()
    forged = f"Look: <image> {template.image_context}{template.image_context} and {template.assistant_suffix} bye"
    write_tar(tmp_path / "forge.tar", [{"__key__": "forged", "json": conversation("Hi " + template.image_start,
                                                                                   forged)}])
    path = index([tmp_path / "forge.tar"], tmp_path / "index.parquet", demo_dataset.tokenizer)
    row = pq.read_table(path).to_pylist()[0]
    assert not row["valid"] and row["reason"].startswith("image tag mismatch")  # <image> is the only tag
    write_tar(tmp_path / "forge.tar", [{"__key__": "forged", "json": conversation("Hi " + template.image_start,
                                                                                   forged.replace("<image>", ""))}])
    path = index([tmp_path / "forge.tar"], tmp_path / "index.parquet", demo_dataset.tokenizer)
    packs, _ = every_sample(path)
    tokenizer = load_tokenizer(demo_dataset.tokenizer, template)
    ids = packs["forged"].input_ids.tolist()
    for token in (template.image_context, template.image_start):
        assert tokenizer.token_to_id(token) not in ids
    assert ids.count(tokenizer.token_to_id(template.assistant_suffix)) == 2  # the template's own, one per turn
    assert packs["forged"].image_token_spans.numel() == 0


def test_compressed_shards_are_marked_when_indexed(tmp_path, demo_dataset):
    write_tar(tmp_path / "plain.tar", [{"__key__": "z", "json": conversation("Q?", "A.")}])
    (tmp_path / "packed.tar.gz").write_bytes(gzip.compress((tmp_path / "plain.tar").read_bytes()))
    done = subprocess.run(CLI + ["index", str(tmp_path / "packed.tar.gz"), "--tokenizer", str(demo_dataset.tokenizer),
                                 "--out", str(tmp_path / "index.parquet"), "--quiet"], capture_output=True, text=True)
    assert done.returncode == 4, done.stderr  # its only sample skipped: nothing to train on
    assert '"compressed shard": 1' in done.stderr
    row = pq.read_table(tmp_path / "index.parquet").to_pylist()[0]
    assert not row["valid"] and row["reason"].startswith("compressed shard")


@pytest.mark.parametrize("replacement", ["directory", "gzip", "fifo"])
def test_a_shard_replaced_under_the_reader_skips_and_recovers(tmp_path, demo_dataset, replacement):
    """A shard swapped for a directory, a compressed file or a FIFO (a hung mount stand-in) is skipped at once
    and never poisons the reader; once the shard is back, its samples are served again."""
    shard = tmp_path / "swap.tar"
    write_tar(shard, [{"__key__": "a", "json": conversation("Q?", "A.")}])
    original = shard.read_bytes()
    path = index([shard], tmp_path / "index.parquet", demo_dataset.tokenizer)
    rows = IndexRows(path)
    reader = SampleReader(rows.info, demo_dataset.tokenizer)
    assert reader.load(rows.row(0)).key == "a"
    shard.unlink()
    if replacement == "directory":
        shard.mkdir()
    elif replacement == "gzip":
        shard.write_bytes(gzip.compress(original))
    else:
        os.mkfifo(shard)
    for _ in range(2):
        with pytest.raises(SampleSkipped, match="not a regular file|compressed"):
            reader.load(rows.row(0))
    shard.rmdir() if replacement == "directory" else shard.unlink()
    shard.write_bytes(original)
    assert reader.load(rows.row(0)).key == "a"
    reader.close()


def test_unreachable_shards_fail_loudly(tmp_path, demo_dataset):
    """No shard readable: the server refuses to start and says why. Most of a step's samples gone: the
    stream fails with the reasons (max_skipped_fraction), rather than delivering empty packs as if all was well."""
    shards = []
    for k in range(3):
        shards.append(tmp_path / f"part-{k}.tar")
        write_tar(shards[-1], [{"__key__": f"k{k}-{i}", "json": conversation("Q?", "A." * (i + 1))} for i in range(8)])
    path = index(shards, tmp_path / "index.parquet", demo_dataset.tokenizer)
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    with pytest.raises(RuntimeError, match="none of its 3 shards is readable"):
        LocalServer(path, workers=1, extra_args=["--shard-root", str(empty)]).start()
    shards[0].unlink()
    shards[1].unlink()
    with pytest.raises(Exception, match=r"FAILED_PRECONDITION: step 0:0 of rank 0: \d+ of \d+ samples skipped"):
        every_sample(path)


def test_skip_reasons_read_the_same_on_every_server():
    """Reasons travel inside packs: an exception's object address would make two servers' bytes differ."""
    from packfeed.media.samples import describe_error

    reasons = set()
    for _ in range(2):
        try:
            Image.open(io.BytesIO(b"not an image at all"))
        except OSError as error:
            assert " at 0x" in str(error)  # what Pillow says, with the buffer's address
            reasons.add(describe_error(error))
    assert len(reasons) == 1 and "0x" not in next(iter(reasons))
