"""Groups in offline data (issue [4/6]): annotations naming a `group` (preference pairs, a prompt's answers) are
converted, indexed with a group column (each group and prompt numbered), planned together, and served by a real
server with each prompt's images read and sent once; the client's unshared view is each sample as indexed. A
sample whose image lies after its prompt keeps its group label but shares nothing."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from group_data import index_annotations
from recipe_data import write_image

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def grouped_index(tmp_path_factory):
    root = tmp_path_factory.mktemp("groups")
    rng = np.random.default_rng(0)
    rows = []
    for g in range(5):  # 5 prompts with an image, 3 answers each
        write_image(root / "images" / f"p{g}.jpg", rng)
        for k in range(3):
            rows.append({"id": f"g{g}-{k}", "group": f"prompt-{g}", "images": [f"p{g}.jpg"],
                         "conversations": [{"from": "human", "value": f"<image>\nWhat is in picture {g}?"},
                                           {"from": "gpt", "value": " ".join(["A scene."] * (1 + k))}]})
    write_image(root / "images" / "late.jpg", rng)  # its image in the answer's turn: after its prompt
    rows.append({"id": "late", "group": "prompt-0", "images": ["late.jpg"],
                 "conversations": [{"from": "human", "value": "What now?"}, {"from": "gpt", "value": "This."},
                                   {"from": "human", "value": "<image>\nAnd this?"}, {"from": "gpt", "value": "That."}]})
    for k in range(4):
        rows.append({"id": f"text-{k}", "conversations": [{"from": "human", "value": "Hello?"},
                                                          {"from": "gpt", "value": "Hi " * (k + 1)}]})
    policy = {"name": "internvl", "image_size": 56, "max_num": 4, "tokens_per_tile": 4}
    return index_annotations(root, rows, policy), rows


def test_an_index_of_grouped_annotations_numbers_each_group_and_prompt(grouped_index):
    index, _ = grouped_index
    table = pq.read_table(index, columns=["key", "group", "prefix_tokens", "llm_tokens", "n_images"]).to_pylist()
    by_key = {row["key"]: row for row in table}
    for g in range(5):
        members = [by_key[key] for key in by_key if key.startswith(f"g{g}-")]
        assert len({m["group"] for m in members}) == 1 and members[0]["group"] >= 0
        assert len({m["prefix_tokens"] for m in members}) == 1 and 2 <= members[0]["prefix_tokens"] < \
            min(m["llm_tokens"] for m in members)
    assert len({by_key[f"g{g}-0"]["group"] for g in range(5)}) == 5
    assert by_key["late"]["group"] == -1 and by_key["text-0"]["group"] == -1  # an image after its prompt: alone


def test_a_server_sends_each_groups_prompt_images_once(grouped_index):
    from packfeed.client import LocalServer, PackStream
    from packfeed.client.model.shared_prefix import shared, unshared

    index, rows = grouped_index
    images_of = {row["id"]: len(row.get("images", [])) for row in rows}
    with LocalServer(index, workers=1) as server:
        stream = PackStream(server.target, job="groups", rank=0, dp=1, microbatches=1, seed=0, vision_cap=64,
                            token_cap=4096)
        packs = [pack for step in stream for pack in step.packs if not pack.empty]
        stream.close()
        alone = PackStream(server.target, job="alone", rank=0, dp=1, microbatches=1, seed=0, vision_cap=64,
                           token_cap=4096, shared_prefix=False)
        alone_packs = [pack for step in alone for pack in step.packs if not pack.empty]
        alone.close()
    keys = [key for pack in packs for key in pack.sample_keys]
    assert sorted(keys) == sorted(images_of)  # every sample once
    siblings = 0
    for pack in packs:
        rows_ = pack.shared_prefix.view(-1, 2).tolist()
        whole = unshared(pack)
        for k, key in enumerate(pack.sample_keys):
            owner, size = rows_[k]
            if owner != k:
                siblings += 1
                assert pack.sample_keys[owner].split("-")[0] == key.split("-")[0] and size > 0
                assert int((pack.image_sample == k).sum()) == 0  # sent once, with its owner
            assert int((whole.image_sample == k).sum()) == images_of[key]
        assert int(shared(pack).image_sample.numel()) <= int(whole.image_sample.numel())
    assert siblings == 10  # 5 groups of 3, each in one pack
    assert all("shared_prefix" not in pack.tensors for pack in alone_packs)  # shared_prefix false: each alone
    assert sum(int(p.image_sample.numel()) for p in alone_packs) == sum(images_of.values())
