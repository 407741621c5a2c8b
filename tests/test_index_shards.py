"""Indexing real tar shards written with webdataset, broken ones included."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from PIL import Image

from packfeed.media.chat import ChatTemplate, encode_conversation, load_tokenizer
from packfeed.media.conversation import attach_images, parse_conversation
from packfeed.media.image_policy import InternVLTiling
from packfeed.server.index.config import IndexConfig
from packfeed.server.index.indexer import build_index
from packfeed.server.index.shards import expand_shards


def _jpeg(w, h, color=(200, 60, 30)):
    buffer = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buffer, format="JPEG")
    return buffer.getvalue()


def _png(w, h):
    buffer = io.BytesIO()
    Image.new("RGB", (w, h), (10, 200, 90)).save(buffer, format="PNG")
    return buffer.getvalue()


def _conv(human="<image>\nWhat is this?", answer="A red square."):
    return json.dumps({"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": answer}]}).encode()


def _renamed(samples, prefix):
    return [{**sample, "__key__": prefix + sample["__key__"]} for sample in samples]


def _write(path, samples):
    with wds.TarWriter(str(path)) as writer:
        for sample in samples:
            writer.write(sample)


@pytest.fixture(scope="module")
def shards(tmp_path_factory, demo_dataset):
    root = tmp_path_factory.mktemp("shards")
    good = [
        {"__key__": "text_only", "json": _conv("Why is the sky blue?", "Rayleigh scattering.")},
        {"__key__": "one_jpg", "jpg": _jpeg(1024, 768), "json": _conv()},
        {"__key__": "two_images", "0.jpg": _jpeg(640, 480), "1.png": _png(300, 900),
         "json": _conv("Image-1: <image>\nImage-2: <image>\nCompare them.", "The first is wider.")},
        {"__key__": "untagged", "png": _png(448, 448), "json": _conv("Describe.", "Green."), "txt": b"extra member"},
    ]
    bad = [
        {"__key__": "no_json", "jpg": _jpeg(100, 100)},
        {"__key__": "bad_json", "json": b'{"conversations": ['},
        {"__key__": "bad_utf8", "json": b'{"conversations": [{"from": "gpt", "value": "\xff\xfe"}]}'},
        {"__key__": "empty_conv", "json": b'{"conversations": []}'},
        {"__key__": "not_image", "jpg": b"this is plain text, not a JPEG", "json": _conv()},
        {"__key__": "cut_image", "jpg": _jpeg(800, 600)[:300], "json": _conv()},
        {"__key__": "tag_mismatch", "jpg": _jpeg(64, 64), "json": _conv("<image> <image> two?", "no")},
        {"__key__": "from_list", "json": b'{"conversations": [{"from": ["human"], "value": "hi"}]}'},
        {"__key__": "too_deep", "json": b'{"conversations": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"},
    ]
    _write(root / "good-000.tar", good)
    _write(root / "bad-samples-000.tar", bad + [{"__key__": "one_jpg", "jpg": _jpeg(32, 32), "json": _conv()},
                                                 {"__key__": "one_jpg", "json": _conv("dup?", "yes")}])
    # A tar truncated inside its third sample's image (keys of their own: a key names one sample in a dataset).
    _write(root / "whole.tar", _renamed(good[:3], "t_"))
    data = (root / "whole.tar").read_bytes()
    (root / "truncated-000.tar").write_bytes(data[: len(data) * 2 // 3])
    (root / "whole.tar").unlink()
    # A corrupt header after the first sample: tarfile would stop quietly; the indexer must say so.
    _write(root / "whole.tar", _renamed(good[:2], "c_"))
    data = bytearray((root / "whole.tar").read_bytes())
    second_header = data.index(b"c_one_jpg.jpg")
    data[second_header:second_header + 512] = b"\x7f" * 512
    (root / "corrupt-header-000.tar").write_bytes(bytes(data))
    # Two zeroed blocks read as the end of the archive: tarfile stops quietly, the data after them is unread.
    data[second_header:second_header + 1024] = b"\0" * 1024
    (root / "zeroed-header-000.tar").write_bytes(bytes(data))
    (root / "whole.tar").unlink()
    (root / "garbage-000.tar").write_bytes(b"not a tar at all" * 100)
    return root


@pytest.fixture(scope="module")
def built(shards, demo_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("index") / "index.parquet"
    config = IndexConfig(tokenizer=str(demo_dataset.tokenizer))
    specs = [str(shards / "{good,bad-samples,truncated,corrupt-header,zeroed-header,garbage}-000.tar"), str(shards / "missing.tar")]
    result = build_index(specs, out, config, workers=2, progress=False)
    return result, pq.read_table(out).to_pylist(), config


def _row(rows, key, shard_part):
    return next(r for r in rows if r["key"] == key and shard_part in r["shard"])


def test_every_bad_input_is_marked_with_its_reason(built):
    result, rows, _ = built
    bad = {r["key"]: r["reason"] for r in rows if "bad-samples" in r["shard"]}
    assert bad["no_json"] == "missing json"
    assert bad["bad_json"].startswith("invalid json")
    assert bad["bad_utf8"].startswith("bad utf-8 in json")
    assert bad["empty_conv"].startswith("empty conversation")
    assert bad["not_image"] == "not an image"
    assert bad["cut_image"].startswith("undecodable image")
    assert bad["tag_mismatch"].startswith("image tag mismatch")
    # one malformed sample never stops the index: it is invalid, with its reason
    assert bad["from_list"].startswith("invalid json: turn 0 needs a string 'from'")
    assert bad["too_deep"] == "invalid json: nested too deeply"
    # a key already in an earlier shard, then again in the same shard
    dup = [r for r in rows if r["key"] == "one_jpg" and "bad-samples" in r["shard"]]
    assert dup[0]["reason"] == f"duplicate key: the key appears earlier in shard {_row(rows, 'one_jpg', 'good')['shard']}"
    assert dup[1]["reason"].startswith("duplicate key: the key appears earlier in this shard")
    assert _row(rows, "one_jpg", "good")["valid"]
    assert result.skipped_anything
    counts = result.info.invalid_by_reason
    assert counts["missing json"] == 1 and counts["not an image"] == 1 and counts["duplicate key"] == 2


def test_broken_shards_are_reported_and_their_readable_samples_kept(built):
    result, rows, _ = built
    errors = {e["shard"].rsplit("/", 1)[-1]: e for e in result.info.skipped_shards}
    assert set(errors) == {"truncated-000.tar", "corrupt-header-000.tar", "zeroed-header-000.tar",
                           "garbage-000.tar", "missing.tar"}
    assert "cannot open" in errors["missing.tar"]["error"]
    assert "not a readable tar" in errors["garbage-000.tar"]["error"]
    assert "corrupt tar" in errors["corrupt-header-000.tar"]["error"]
    assert "corrupt tar" in errors["zeroed-header-000.tar"]["error"]
    # The sample before a broken header may have lost members: it is kept in the index but not trusted.
    assert errors["corrupt-header-000.tar"]["samples_read"] == 1
    assert errors["zeroed-header-000.tar"]["samples_read"] == 1
    truncated = [r for r in rows if "truncated" in r["shard"]]
    assert [r["valid"] for r in truncated[:2]] == [True, True]
    assert truncated[-1]["reason"].startswith("truncated tar")


def test_valid_samples_costs_match_what_serving_produces(built, shards):
    """Read each valid sample back by its recorded offsets and re-encode it: same sizes, same token count."""
    _, rows, config = built
    template = ChatTemplate.from_dict(config.chat_template)
    tokenizer = load_tokenizer(config.tokenizer, template)
    policy = InternVLTiling()
    checked = 0
    for row in rows:
        if not row["valid"]:
            continue
        with open(row["shard"], "rb") as f:
            f.seek(row["json_offset"])
            turns = parse_conversation(f.read(row["json_size"]))
            image_tokens = []
            for offset, size, w, h in zip(row["image_offsets"], row["image_sizes"], row["image_widths"],
                                          row["image_heights"]):
                f.seek(offset)
                with Image.open(io.BytesIO(f.read(size))) as image:
                    assert image.size == (w, h)
                image_tokens.append(policy.cost(w, h, row["n_images"]).llm_tokens)
        ids, labels = encode_conversation(attach_images(turns, row["n_images"]), image_tokens, tokenizer, template)
        assert len(ids) == row["llm_tokens"]
        assert int((labels != -100).sum()) == row["loss_tokens"]
        assert row["vision_tokens"] == sum(image_tokens)
        checked += 1
    assert checked >= 6


def test_known_sample_costs(built):
    _, rows, _ = built
    one = _row(rows, "one_jpg", "good")
    assert (one["image_widths"], one["image_heights"], one["vision_units"]) == ([1024], [768], 13)
    two = _row(rows, "two_images", "good")
    assert two["image_names"] == ["0.jpg", "1.png"] and two["n_images"] == 2
    text = _row(rows, "text_only", "good")
    assert text["n_images"] == 0 and text["vision_units"] == 0 and text["llm_tokens"] > 0
    assert _row(rows, "untagged", "good")["valid"]


def test_index_does_not_depend_on_worker_count(shards, demo_dataset, tmp_path):
    config = IndexConfig(tokenizer=str(demo_dataset.tokenizer))
    spec = [str(shards / "*-000.tar")]
    one = build_index(spec, tmp_path / "one.parquet", config, workers=1, progress=False)
    two = build_index(spec, tmp_path / "two.parquet", config, workers=2, progress=False)
    assert one.info.fingerprint == two.info.fingerprint
    assert pq.read_table(tmp_path / "one.parquet").equals(pq.read_table(tmp_path / "two.parquet"))


def test_pipe_sources_and_brace_patterns(shards, demo_dataset, tmp_path):
    assert expand_shards([str(shards / "{good,bad-samples}-000.tar")])[0].endswith("good-000.tar")
    config = IndexConfig(tokenizer=str(demo_dataset.tokenizer))
    piped = build_index([f"pipe:cat {shards / 'good-000.tar'}"], tmp_path / "p.parquet", config, workers=1,
                        progress=False)
    direct = build_index([str(shards / "good-000.tar")], tmp_path / "d.parquet", config, workers=1, progress=False)
    assert piped.rows == direct.rows == 4 and piped.valid == 4
    a = pq.read_table(tmp_path / "p.parquet").column("llm_tokens").to_pylist()
    assert a == pq.read_table(tmp_path / "d.parquet").column("llm_tokens").to_pylist()


def test_cli_index_plan_stats_end_to_end(shards, demo_dataset, tmp_path):
    """The three commands as a user runs them: exit status tells whether anything was skipped."""
    cli = [sys.executable, "-m", "packfeed.cli"]
    index = tmp_path / "index.parquet"
    done = subprocess.run(cli + ["index", str(shards / "good-000.tar"), str(shards / "bad-samples-000.tar"),
                                 "--tokenizer", str(demo_dataset.tokenizer), "--out", str(index), "--quiet"],
                          capture_output=True, text=True)
    assert done.returncode == 3, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["invalid"] == 11
    clean = subprocess.run(cli + ["index", *map(str, demo_dataset.shards[:1]), "--tokenizer",
                                  str(demo_dataset.tokenizer), "--out", str(tmp_path / "clean.parquet"), "--quiet",
                                  "--verify-images", "header"], capture_output=True, text=True)
    assert clean.returncode in (0, 3), clean.stderr  # the demo shard may hold a deliberately broken sample
    plan = subprocess.run(cli + ["plan", "--index", str(index), "--dp", "2", "--microbatches", "2", "--out",
                                 str(tmp_path / "plan.parquet")], capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    summary = json.loads(plan.stdout.strip().splitlines()[-1])
    for key in ("samples", "packs", "steps", "samples_per_pack", "pad_ratio", "vit_dist", "llm_dist",
                "planning_seconds"):
        assert key in summary
    table = pq.read_table(tmp_path / "plan.parquet")
    assert {"epoch", "step", "rank", "microbatch", "sample_id"} <= set(table.column_names)
    valid_ids = np.flatnonzero(pq.read_table(index).column("valid").to_numpy(zero_copy_only=False))
    planned = table.column("sample_id").to_numpy()
    assert np.array_equal(np.sort(planned[planned >= 0]), valid_ids)
    stats = subprocess.run(cli + ["stats", "--index", str(index), "--dp", "2", "--microbatches", "2", "--out",
                                  str(tmp_path / "report")], capture_output=True, text=True)
    assert stats.returncode == 0, stats.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["invalid_by_reason"]["not an image"] == 1
    assert [r["strategy"] for r in report["comparison"]] == ["random", "length-group", "isf", "isf+balance",
                                                             "isf+balance, not collective-safe"]
    html = (tmp_path / "report" / "report.html").read_text()
    assert "data:image/png;base64," in html and "not an image" in html
    assert "| isf+balance |" in (tmp_path / "report" / "report.md").read_text()


def test_cli_errors_are_clear(tmp_path):
    cli = [sys.executable, "-m", "packfeed.cli"]
    done = subprocess.run(cli + ["plan", "--index", str(tmp_path / "nope.parquet")], capture_output=True, text=True)
    assert done.returncode == 2 and "error" in done.stderr
    done = subprocess.run(cli + ["index", str(tmp_path / "x.tar"), "--out", str(tmp_path / "i.parquet")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "--tokenizer" in done.stderr


def test_an_index_or_a_plan_with_nothing_to_train_on_exits_4_saying_so(shards, demo_dataset, tmp_path):
    """Shards of only broken samples index to no valid row, and their plan holds no pack: both commands say so
    and exit 4, where a partly skipped index exits 3."""
    cli = [sys.executable, "-m", "packfeed.cli"]
    empty, broken = tmp_path / "empty.tar", tmp_path / "broken.tar"
    _write(empty, [])
    _write(broken, [{"__key__": f"b{k}", "jpg": _jpeg(64, 64)[:200], "json": _conv()} for k in range(3)])
    for shard, rows in ((empty, 0), (broken, 3)):
        index = tmp_path / f"{shard.stem}.parquet"
        done = subprocess.run(cli + ["index", str(shard), "--tokenizer", str(demo_dataset.tokenizer), "--out",
                                     str(index), "--quiet"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 4, done.stderr
        assert f"holds no valid sample ({rows} rows" in done.stderr
        plan = subprocess.run(cli + ["plan", "--index", str(index), "--dp", "2"], capture_output=True, text=True,
                              timeout=300)
        assert plan.returncode == 4 and "the plan holds no pack (0 valid samples" in plan.stderr, plan.stderr
