"""`packfeed index --from-lengths`: OmniBal/InternVL length files as an index."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from packfeed.server.plan.costs import load_sample_loads
from packfeed.server.index.lengths import index_from_lengths


def test_files_concatenate_in_argument_order_and_bad_records_are_reported(tmp_path):
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    a.write_text(json.dumps([{"vit_num": 5, "token_num": 1341, "image_flags": 5},
                             {"vit_num": 1, "token_num": 300, "image_flags": 0}]))
    b.write_text(json.dumps([{"vit_num": 3, "token_num": 0, "image_flags": 3},
                             {"vit_num": 2, "token_num": 700}]))
    info = index_from_lengths([b, a], tmp_path / "i.parquet")
    rows = pq.read_table(tmp_path / "i.parquet").to_pylist()
    assert [(r["shard"], r["key"]) for r in rows] == [("b.json", "0"), ("b.json", "1"), ("a.json", "0"),
                                                        ("a.json", "1")]
    assert [r["sample_id"] for r in rows] == [0, 1, 2, 3]
    assert [r["vision_units"] for r in rows] == [3, 2, 5, 1]
    assert [r["llm_tokens"] for r in rows] == [0, 700, 1341, 300]
    assert [r["vision_tokens"] for r in rows] == [768, 512, 1280, 0]  # image_flags x 256
    assert rows[0]["valid"] is False and "bad length record" in rows[0]["reason"]
    assert all(r["reason"] is None for r in rows[1:])
    assert sum(info.invalid_by_reason.values()) == 1
    loads, _ = load_sample_loads(tmp_path / "i.parquet")
    assert np.array_equal(loads.valid, [False, True, True, True])


def test_malformed_length_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"vit": 1}]))
    with pytest.raises(ValueError, match="vit_num"):
        index_from_lengths([bad], tmp_path / "i.parquet")
