"""`packfeed convert`: a team's recipe (LLaVA JSON, an InternVL meta file over JSONL annotations, ShareGPT, HF
Parquet, image folders with some images missing or corrupt) converted into shards, indexed, mixed, planned and
served over gRPC; every rejected row reported; conversions atomic and deterministic."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from recipe_data import write_annotation, write_image

CLI = [sys.executable, "-m", "packfeed.cli"]


def packfeed(*args, expect: int | None = 0) -> subprocess.CompletedProcess:
    done = subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=300)
    if expect is not None:
        assert done.returncode == expect, done.stderr
    return done


def report_of(out: Path) -> dict:
    return json.loads((out / "convert-report.json").read_text())


def shard_samples(out: Path) -> dict[str, dict[str, bytes]]:
    """key -> {suffix: bytes} over every shard of a conversion."""
    samples: dict[str, dict[str, bytes]] = {}
    for shard in sorted(out.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar:
                key, suffix = member.name.split(".", 1)
                samples.setdefault(key, {})[suffix] = tar.extractfile(member).read()
    return samples


@pytest.fixture
def tokenizer(tmp_path_factory) -> Path:
    from packfeed.server.tools.demo import train_tokenizer

    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_llava_rows_convert_with_stable_keys_and_every_rejection_reported(tmp_path, tokenizer):
    source = write_annotation(tmp_path, "llava", 24, seed=0, jsonl=False)
    out = tmp_path / "out"
    done = packfeed("convert", "llava", source.path, "--image-root", source.image_root, "--out", out, "--index",
                    "--tokenizer", tokenizer, "--workers", "2", "--quiet", expect=3)  # 3: rows were rejected
    summary = json.loads(done.stdout)
    report = report_of(out)
    assert summary["converted"] == report["converted"] == len(source.good_ids)
    rejected = {row["id"]: row["reason"] for row in report["rejected_rows"]}
    assert set(rejected) == set(source.missing_ids) | set(source.bad_ids)
    assert all(rejected[i].startswith("missing image: sub/") for i in source.missing_ids)
    assert rejected["llava-0001"].startswith("undecodable image")
    assert rejected["llava-0002"].startswith("bad conversation")
    assert report["rejected_by_reason"] == {"bad conversation": 1, "missing image": 2, "undecodable image": 1}

    samples = shard_samples(out)
    assert sorted(samples) == sorted(source.good_ids)  # keys are the source ids
    entries = {e["id"]: e for e in json.loads(source.path.read_text())}
    for key, members in samples.items():
        doc = json.loads(members["json"])
        assert doc["conversations"] == entries[key]["conversations"]
        paths = entries[key].get("images") or [entries[key]["image"]]
        images = [members[s] for s in sorted(s for s in members if s != "json")]
        assert images == [(source.image_root / p).read_bytes() for p in paths]  # image bytes unchanged
    index = summary["index"]
    assert index["rows"] == index["valid"] == len(source.good_ids)

    again = tmp_path / "again"
    packfeed("convert", "llava", source.path, "--image-root", source.image_root, "--out", again, "--workers", "1",
             "--quiet", expect=3)
    assert [p.read_bytes() for p in sorted(again.glob("*.tar"))] == [p.read_bytes() for p in sorted(out.glob("*.tar"))]
    refused = packfeed("convert", "llava", source.path, "--image-root", source.image_root, "--out", again, expect=2)
    assert "--overwrite" in refused.stderr


def test_sharegpt_messages_and_hf_parquet_image_bytes(tmp_path, tokenizer):
    import numpy as np

    rng = np.random.default_rng(3)
    write_image(tmp_path / "a.jpg", rng)
    write_image(tmp_path / "b.png", rng, "PNG")
    rows = [{"id": "s1", "images": ["a.jpg"], "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
                {"role": "assistant", "content": "A picture."}]},
            {"id": "s2", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
            {"id": "s3", "images": ["b.png"], "messages": [{"role": "narrator", "content": "?"}]}]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    packfeed("convert", "sharegpt", tmp_path / "chat.jsonl", "--out", tmp_path / "sg", "--index", "--tokenizer",
             tokenizer, "--quiet", expect=3)
    samples, report = shard_samples(tmp_path / "sg"), report_of(tmp_path / "sg")
    assert sorted(samples) == ["s1", "s2"]
    assert json.loads(samples["s1"]["json"])["conversations"][0] == {"from": "user", "value": "<image>\nWhat is this?"}
    assert samples["s1"]["jpg"] == (tmp_path / "a.jpg").read_bytes()
    reasons = {row["position"]: row["reason"] for row in report["rejected_rows"]}
    assert reasons[2].startswith("bad conversation") and "narrator" in reasons[2]
    assert reasons[3].startswith("unreadable row: line 4")
    assert report["index"]["valid"] == 2

    image_type = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    turn = pa.struct([("role", pa.string()), ("content", pa.string())])
    table = pa.table({
        "id": ["p0", "p1", "p2", "p.3"],
        "images": pa.array([[{"bytes": (tmp_path / "a.jpg").read_bytes(), "path": "a.jpg"}],
                            [{"bytes": None, "path": "b.png"}],  # bytes elsewhere: read from the image root
                            [{"bytes": b"garbage", "path": "c.jpg"}],
                            [{"bytes": (tmp_path / "b.png").read_bytes(), "path": None}]], type=image_type),
        "messages": pa.array([[{"role": "user", "content": "<image>\nDescribe."},
                               {"role": "assistant", "content": "A scene."}]] * 4, type=pa.list_(turn))})
    (tmp_path / "hf").mkdir()
    pq.write_table(table.slice(0, 2), tmp_path / "hf" / "train-00000.parquet")
    pq.write_table(table.slice(2), tmp_path / "hf" / "train-00001.parquet")
    packfeed("convert", "hf-parquet", tmp_path / "hf", "--image-root", tmp_path, "--out", tmp_path / "pq", "--index",
             "--tokenizer", tokenizer, "--quiet", expect=3)
    samples, report = shard_samples(tmp_path / "pq"), report_of(tmp_path / "pq")
    assert sorted(samples) == ["p0", "p1", "p_3"]  # the dot cannot be in a WebDataset key
    assert samples["p1"]["png"] == (tmp_path / "b.png").read_bytes()
    assert report["rejected_rows"] == [{"id": "p2", "position": 2, "reason": "not an image"}]
    assert report["renamed_keys"] == [{"id": "p.3", "position": 3, "key": "p_3"}]


def test_a_killed_conversion_leaves_no_complete_looking_shard(tmp_path):
    source = write_annotation(tmp_path, "big", 400, seed=5, jsonl=True, missing=0)
    out = tmp_path / "out"
    process = subprocess.Popen(CLI + ["convert", "internvl", str(source.path), "--image-root", str(source.image_root),
                                      "--out", str(out), "--shard-size-mb", "1", "--workers", "1", "--quiet"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(out.glob("shard-*.tar")) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait(30)
    assert not (out / "convert-report.json").exists(), "the conversion finished before it could be killed"
    shards = sorted(out.glob("shard-*.tar"))
    assert shards  # and a .partial unless the kill fell between one shard's rename and the next one's start
    for shard in shards:  # every .tar is whole: it reads to its end-of-archive marker
        with tarfile.open(shard) as tar:
            names = tar.getnames()
        assert names and names[0].endswith(".json") and shard.read_bytes()[-1024:] == b"\0" * 1024
    packfeed("convert", "internvl", source.path, "--image-root", source.image_root, "--out", out, "--overwrite",
             "--shard-size-mb", "1", "--quiet", expect=3)
    assert not list(out.glob("*.partial"))
    assert len(shard_samples(out)) == report_of(out)["converted"] == len(source.good_ids)


def recipe(tmp_path: Path, tokenizer: Path) -> tuple[Path, dict]:
    """A LLaVA JSON (repeat 1) and an InternVL meta over two JSONL datasets (repeat 2 and 0.4), converted,
    indexed and mixed. Returns the mixture file and each dataset's annotation."""
    llava = write_annotation(tmp_path, "llava", 16, seed=1, jsonl=False)
    chart = write_annotation(tmp_path, "chart", 14, seed=2, jsonl=True)
    doc = write_annotation(tmp_path, "doc", 17, seed=3, jsonl=True, missing=3)
    meta = {"chartqa": {"root": str(chart.image_root), "annotation": str(chart.path), "repeat_time": 2,
                        "length": 14, "max_dynamic_patch": 2, "data_augment": False},
            "docvqa": {"root": doc.image_root.name, "annotation": doc.path.name, "repeat_time": 0.4, "length": 20}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    common = ["--index", "--tokenizer", tokenizer, "--max-tiles", "4", "--quiet"]
    done = packfeed("convert", "internvl-meta", tmp_path / "meta.json", "--image-root", tmp_path, "--out",
                    tmp_path / "recipe", *common, expect=3)
    summary = json.loads(done.stdout)
    packfeed("convert", "llava", llava.path, "--image-root", llava.image_root, "--out", tmp_path / "recipe" / "llava",
             *common, expect=3)
    mixture = yaml.safe_load((tmp_path / "recipe" / "mixture.yaml").read_text())
    mixture["datasets"]["llava"] = {"index": "llava/index.parquet", "repeat": 1}
    (tmp_path / "recipe" / "mixture.yaml").write_text(yaml.safe_dump(mixture))
    return tmp_path / "recipe" / "mixture.yaml", {"summary": summary, "chartqa": chart, "docvqa": doc, "llava": llava}


def serve_epochs(mix: Path) -> list[tuple[int, str, str]]:
    from packfeed.client import LocalServer, PackStream

    received = []
    with LocalServer(None, workers=1, extra_args=["--mixture", str(mix)]) as server:
        for rank in range(2):
            with PackStream(server.target, job="recipe", rank=rank, dataset="meta", dp=2, microbatches=2,
                            epochs=2) as stream:
                received += [(step.epoch, key, source) for step in stream
                             for key, source in zip(step.sample_keys, step.sample_sources)]
    return received


@pytest.mark.slow
def test_a_recipe_is_converted_mixed_planned_and_served(tmp_path, tokenizer):
    mix, recipe_files = recipe(tmp_path, tokenizer)
    summary = recipe_files["summary"]["datasets"]
    assert summary["chartqa"]["max_dynamic_patch"] == 2 and summary["chartqa"]["ignored_keys"] == ["data_augment"]
    assert summary["docvqa"]["length_matches"] is False  # the meta says 20, the annotation holds 17
    for name in ("chartqa", "docvqa", "llava"):  # the missing and broken rows are reported by id
        rejected = {row["id"] for row in report_of(mix.parent / name)["rejected_rows"]}
        assert rejected == set(recipe_files[name].missing_ids) | set(recipe_files[name].bad_ids)
    chart_policy = pq.read_schema(mix.parent / "chartqa" / "index.parquet").metadata
    assert b'"max_num": 2' in next(v for k, v in chart_policy.items() if b"packfeed" in k)

    plan = tmp_path / "plan.parquet"
    packfeed("plan", "--mixture", mix, "--dp", "2", "--microbatches", "2", "--out", plan)
    planned = Counter(row["dataset"] for row in pq.read_table(plan, columns=["dataset", "empty"]).to_pylist()
                      if not row["empty"])
    good = {name: recipe_files[name].good_ids for name in ("chartqa", "docvqa", "llava")}
    assert planned == {"chartqa": 2 * len(good["chartqa"]), "llava": len(good["llava"]),
                       "docvqa": round(0.4 * len(good["docvqa"]))}

    received = serve_epochs(mix)
    subsets = []
    for epoch in (0, 1):
        counts = Counter((source, key) for e, key, source in received if e == epoch)
        assert {key: n for (source, key), n in counts.items() if source == "chartqa"} == \
            {key: 2 for key in good["chartqa"]}
        assert {key: n for (source, key), n in counts.items() if source == "llava"} == {key: 1 for key in good["llava"]}
        subset = {key for (source, key), n in counts.items() if source == "docvqa" and n == 1}
        assert len(subset) == round(0.4 * len(good["docvqa"])) and subset <= set(good["docvqa"])
        assert sum(n for (source, _), n in counts.items() if source == "docvqa") == len(subset)
        subsets.append(subset)
    assert subsets[0] != subsets[1]  # another seeded subset each epoch
    assert serve_epochs(mix) == received  # a rerun is identical


def test_internvl_meta_files_are_checked(tmp_path):
    from packfeed.server.convert.internvl_meta import read_meta

    meta = tmp_path / "meta.json"
    for body, message in [({"a": {"root": "x"}}, "needs an `annotation`"),
                          ({"a": {"annotation": "a.jsonl", "repeat_time": 0}}, "repeat_time 0"),
                          ({"a": {"annotation": "a.jsonl", "max_dynamic_patch": "6"}}, "max_dynamic_patch"),
                          ({"a/b": {"annotation": "x"}, "a_b": {"annotation": "y"}}, "same folder"),
                          ([], "maps dataset names")]:
        meta.write_text(json.dumps(body))
        with pytest.raises(ValueError, match=message):
            read_meta(meta)
    meta.write_text(json.dumps({"ai2d": {"root": "img", "annotation": "ai2d.jsonl", "repeat_time": 0.3}}))
    (dataset,) = read_meta(meta, base=tmp_path)
    assert (dataset.root, dataset.annotation, dataset.repeat) == (str(tmp_path / "img"),
                                                                    str(tmp_path / "ai2d.jsonl"), 0.3)


def test_an_image_path_cannot_leave_the_image_root(tmp_path):
    import numpy as np

    write_image(tmp_path / "secret.jpg", np.random.default_rng(0))
    (tmp_path / "root").mkdir()
    rows = [{"id": "x", "image": "../secret.jpg", "conversations": [
        {"from": "human", "value": "<image>\nHi"}, {"from": "gpt", "value": "Hello."}]}]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    packfeed("convert", "llava", tmp_path / "a.json", "--image-root", tmp_path / "root", "--out", tmp_path / "o",
             "--quiet", expect=3)
    assert report_of(tmp_path / "o")["rejected_rows"][0]["reason"] == \
        f"image outside the image root: ../secret.jpg (resolves to {tmp_path / 'secret.jpg'})"


def test_converted_images_keep_their_format(tmp_path):
    from packfeed.server.convert.convert import EXTENSIONS
    from packfeed.server.index.shards import IMAGE_EXTENSIONS

    assert set(EXTENSIONS.values()) <= set(IMAGE_EXTENSIONS)  # every written suffix is one the indexer reads
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), "red").save(buffer, format="WEBP")
    (tmp_path / "r.webp").write_bytes(buffer.getvalue())
    rows = [{"id": "w", "image": "r.webp", "conversations": [
        {"from": "human", "value": "Colour?"}, {"from": "gpt", "value": "Red."}]}]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    packfeed("convert", "llava", tmp_path / "a.json", "--out", tmp_path / "o", "--quiet")
    assert set(shard_samples(tmp_path / "o")["w"]) == {"json", "webp"}
    assert os.path.getsize(tmp_path / "o" / "shard-000000.tar") > 0


def test_the_cli_offers_every_source_format():
    """The parser lists formats without importing the converters; the two lists stay in step."""
    from packfeed.cli.convert import FORMATS as OFFERED
    from packfeed.server.convert.sources import FORMATS

    assert set(OFFERED) == set(FORMATS) | {"internvl-meta"}


def test_convert_reads_only_regular_files_within_the_root_and_the_size_cap(tmp_path):
    """Rows naming a FIFO, /dev/zero, a directory, a socket, a 6 GB sparse .jpg, a file outside the root by
    absolute path and through a symlink inside the root: the conversion finishes within seconds, each of those
    rows rejected with its reason, the good rows converted. With --trust-absolute-paths the absolute path is
    read as written; a symlink out of the root never is."""
    import socket

    import numpy as np

    rng = np.random.default_rng(4)
    root, outside = tmp_path / "root", tmp_path / "outside"
    write_image(root / "good.jpg", rng)
    write_image(root / "good2.png", rng, "PNG")
    write_image(outside / "secret.png", rng, "PNG")
    os.mkfifo(root / "fifo.jpg")
    (root / "folder.jpg").mkdir()
    with open(root / "sparse.jpg", "wb") as sparse:
        sparse.truncate(6 << 30)  # 6 GB that take no disk
    (root / "link.png").symlink_to(outside / "secret.png")
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(root / "socket.jpg"))
    paths = {"good": "good.jpg", "good2": "good2.png", "fifo": "fifo.jpg", "zero": "/dev/zero",
             "folder": "folder.jpg", "socket": "socket.jpg", "sparse": "sparse.jpg",
             "absolute": str(outside / "secret.png"), "link": "link.png"}
    rows = [{"id": name, "image": path, "conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A picture."}]}
        for name, path in paths.items()]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    started = time.monotonic()
    packfeed("convert", "llava", tmp_path / "a.json", "--image-root", root, "--out", tmp_path / "o", "--quiet",
             expect=3)
    assert time.monotonic() - started < 60
    listening.close()
    reasons = {row["id"]: row["reason"] for row in report_of(tmp_path / "o")["rejected_rows"]}
    assert reasons["fifo"] == "image not a regular file: fifo.jpg is a FIFO"
    assert reasons["folder"] == "image not a regular file: folder.jpg is a directory"
    assert reasons["socket"] == "image not a regular file: socket.jpg is a socket"
    assert reasons["zero"].startswith("image outside the image root: /dev/zero") and "--trust-absolute-paths" in reasons["zero"]
    assert reasons["sparse"] == "image too large: sparse.jpg is 6,442,450,944 bytes, over --max-image-mb 64"
    assert reasons["absolute"].startswith(f"image outside the image root: {outside / 'secret.png'}")
    assert reasons["link"] == f"image outside the image root: link.png (resolves to {outside / 'secret.png'})"
    secret = (outside / "secret.png").read_bytes()
    samples = shard_samples(tmp_path / "o")
    assert set(samples) == {"good", "good2"} and all(secret not in m for s in samples.values() for m in s.values())

    # trusted: the absolute path is read as written, /dev/zero is still not a regular file, the symlink still out
    packfeed("convert", "llava", tmp_path / "a.json", "--image-root", root, "--out", tmp_path / "t", "--quiet",
             "--trust-absolute-paths", "--max-image-mb", "1", "--workers", "1", expect=3)
    reasons = {row["id"]: row["reason"] for row in report_of(tmp_path / "t")["rejected_rows"]}
    assert reasons["zero"] == "image not a regular file: /dev/zero is a character device"
    assert "absolute" not in reasons and reasons["link"].startswith("image outside the image root: link.png")
    assert reasons["sparse"].endswith("over --max-image-mb 1")
    assert shard_samples(tmp_path / "t")["absolute"]["png"] == secret
