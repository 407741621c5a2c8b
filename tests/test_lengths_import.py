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


def test_image_flags_as_a_per_tile_list_is_read_and_a_wrong_type_is_named(tmp_path):
    """InternVL keeps `image_flags` as a 0/1 flag per tile: such a list counts its real tiles; another type is an
    error naming the record and the field (not vit_num and token_num, which were right)."""
    from packfeed.server.index.lengths import read_length_file

    listed = tmp_path / "listed.json"
    listed.write_text(json.dumps([{"vit_num": 3, "token_num": 900, "image_flags": [1, 1, 0]},
                                  {"vit_num": 1, "token_num": 50, "image_flags": 0}]))
    _, _, flags = read_length_file(listed)
    assert flags.tolist() == [2, 0]
    for name, flags_value, message in (("short", [1, 1], "2 entries for vit_num 3"),
                                       ("text", "3", "record 0: 'image_flags' is str")):
        bad = tmp_path / f"{name}.json"
        bad.write_text(json.dumps([{"vit_num": 3, "token_num": 900, "image_flags": flags_value}]))
        with pytest.raises(ValueError, match=message) as refused:
            index_from_lengths([bad], tmp_path / f"{name}.parquet")
        assert "'vit_num' and 'token_num'" not in str(refused.value)
