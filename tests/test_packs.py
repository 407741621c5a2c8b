"""Serve-time pre-processing and pack assembly on real shards: counts match the index and the plan."""

from __future__ import annotations

import hashlib
import shutil

import numpy as np
import pytest

from packfeed.media.chat import ChatTemplate, load_tokenizer
from packfeed.server.index.table import read_index_info
from packfeed.server.plan.costs import load_sample_loads
from packfeed.server.plan.planner import make_plan
from packfeed.server.serve.index_rows import SERVE_COLUMNS, IndexRows
from packfeed.server.serve.packs import Pack, build_pack
from packfeed.server.serve.preprocess import SampleReader
from packfeed.server.serve.wire import encode_pack
from packfeed.v1.options import PlanConfig

TILE_BYTES = 3 * 448 * 448


def build_rank_step(plan, rows: IndexRows, reader, step: int, rank: int) -> list[Pack]:
    """The rank's M packs of one step of a one-index plan, in the plan's (1F1B) order, built in this process.

    `step_loss_tokens` counts the planned loss tokens of the whole global step (from the index, which used
    the same encoder), so every rank normalises by the same number without seeing the others' packs.
    """
    config = plan.config
    packs = []
    step_loss = rows.loss_tokens(plan.step_members(step))
    for microbatch in range(config.microbatches):
        members, truncate_to = plan.pack_with_truncation(step, rank, microbatch)
        pack = build_pack([(rows, reader, "")], members, truncate_to, np.zeros(len(members), np.int32), plan.epoch,
                          step, rank, microbatch, plan.seed)
        pack.step_loss_tokens = step_loss
        packs.append(pack)
    return packs


@pytest.fixture(scope="module")
def served(dataset, demo_dataset):
    root, index = dataset.parent, dataset
    loads, info = load_sample_loads(index)
    plan = make_plan(loads, PlanConfig(dp=2, microbatches=2, pipeline_stages=2), 0, 0, info.fingerprint)
    return root, index, plan, demo_dataset.tokenizer


def _all_packs(plan, rows, reader):
    return [pack for step in range(plan.n_steps) for rank in range(plan.config.dp)
            for pack in build_rank_step(plan, rows, reader, step, rank)]


def test_packs_match_the_index_and_the_plan(served):
    _, index, plan, tokenizer = served
    rows = IndexRows(index)
    reader = SampleReader(rows.info, tokenizer)
    context = load_tokenizer(tokenizer, ChatTemplate()).token_to_id("<IMG_CONTEXT>")
    seen = []
    for pack in _all_packs(plan, rows, reader):
        ids = pack.sample_keys
        planned = plan.pack(pack.step, pack.rank, pack.microbatch)
        index_rows = [rows.row(s) for s in planned]
        assert ids == [r["key"] for r in index_rows] and not pack.skipped
        t = pack.tensors
        assert len(t["input_ids"]) == sum(r["llm_tokens"] for r in index_rows)
        assert pack.loss_tokens == sum(r["loss_tokens"] for r in index_rows) == int((t["labels"] != -100).sum())
        assert t["cu_seqlens"][0] == 0 and t["cu_seqlens"][-1] == len(t["input_ids"])
        starts = t["cu_seqlens"][:-1]
        assert (t["position_ids"][starts] == 0).all() if len(starts) else True
        assert len(t["tile_shapes"]) == sum(rows_vision(r) for r in index_rows)
        assert len(t["pixels"]) == int(np.prod(t["tile_shapes"], axis=1).sum())
        assert (t["tile_shapes"] == [3, 448, 448]).all()
        for start, length in t["image_token_spans"]:
            assert (t["input_ids"][start:start + length] == context).all()
        assert len(t["image_sample"]) == sum(r["n_images"] for r in index_rows)
        seen.extend(ids)
        assert pack.step_loss_tokens >= pack.loss_tokens
    valid = [rows.row(i)["key"] for i in range(rows.table.num_rows) if rows.row(i)["valid"]]
    assert sorted(seen) == sorted(valid)  # every valid sample exactly once


def rows_vision(row):
    from packfeed.media.image_policy import InternVLTiling

    return sum(InternVLTiling().cost(w, h, row["n_images"]).units for w, h in zip(row["image_widths"],
                                                                                  row["image_heights"]))


def test_same_plan_same_bytes(served):
    _, index, plan, tokenizer = served

    def digest():
        rows = IndexRows(index)
        reader = SampleReader(rows.info, tokenizer)
        h = hashlib.sha256()
        for pack in build_rank_step(plan, rows, reader, 1, 1):
            h.update(encode_pack(pack, 2, False))
        return h.hexdigest()

    assert digest() == digest()


def test_broken_image_or_vanished_shard_is_skipped_and_reported(served, tmp_path):
    root, index, plan, tokenizer = served
    rows = IndexRows(index)
    broken_dir = tmp_path / "shards"
    broken_dir.mkdir()
    for p in root.glob("*.tar"):
        shutil.copy(p, broken_dir / p.name)
    # Overwrite the first image of the first pack's first multimodal sample with zeros.
    target = next(s for s in plan.pack(0, 0, 0).tolist() + plan.pack(0, 1, 0).tolist()
                  if rows.row(s)["n_images"])
    row = rows.row(target)
    with open(broken_dir / row["shard"].rsplit("/", 1)[-1], "r+b") as f:
        f.seek(row["image_offsets"][0])
        f.write(b"\0" * row["image_sizes"][0])
    reader = SampleReader(rows.info, tokenizer, shard_root=broken_dir)
    packs = build_rank_step(plan, rows, reader, 0, 0) + build_rank_step(plan, rows, reader, 0, 1)
    skipped = [(key, reason) for pack in packs for key, reason in pack.skipped]
    assert skipped == [(row["key"], skipped[0][1])] and "shard changed" in skipped[0][1] and "checksum" in skipped[0][1]
    assert sum(len(p.sample_keys) for p in packs) == sum(len(plan.pack(0, r, m)) for r in range(2)
                                                         for m in range(2)) - 1
    # A shard that vanished: its samples are skipped with the reason, the packs still go out.
    for p in broken_dir.glob("*.tar"):
        p.unlink()
    packs = build_rank_step(plan, rows, reader, 0, 0)
    assert all(p.empty for p in packs)
    assert all("shard unreadable" in reason for p in packs for _, reason in p.skipped)


def test_serving_with_another_tokenizer_is_refused(served, tmp_path):
    _, index, _, _ = served
    from packfeed.server.tools.demo import train_tokenizer

    other = train_tokenizer(tmp_path / "other.json", vocab_size=600)
    with pytest.raises(ValueError, match="differs from the one the index was built with"):
        SampleReader(read_index_info(index), other)


def test_serving_columns_are_memory_mapped_from_one_arrow_file(tmp_path, small_tile_index):
    """The first IndexRows writes the columns serving reads as an uncompressed Arrow file beside the index;
    later ones (the workers) map it; its rows are the index's."""
    from packfeed.server.index.table import read_index

    index = tmp_path / "index.parquet"
    shutil.copy(small_tile_index, index)
    rows = IndexRows(index)
    mapped = list(tmp_path.glob("index.*.serve.arrow"))
    assert len(mapped) == 1 and rows.info.fingerprint[:16] in mapped[0].name
    written = mapped[0].stat().st_mtime_ns
    again = IndexRows(index)
    assert mapped[0].stat().st_mtime_ns == written  # mapped, not written again
    table = read_index(index, columns=SERVE_COLUMNS)[0]
    for sample_id in (0, len(table) // 2, len(table) - 1):
        assert again.row(sample_id) == table.slice(sample_id, 1).to_pylist()[0]
    ids = np.random.default_rng(0).choice(len(table), size=min(40, len(table)), replace=False)
    assert again.loss_tokens(ids) == int(table.column("loss_tokens").to_numpy()[ids].sum())
    widths, heights = table.column("image_widths").to_pylist(), table.column("image_heights").to_pylist()
    largest = max(w * h for i in ids for w, h in zip(widths[i], heights[i]))
    assert again.largest_image_pixels(ids) == largest > 0
