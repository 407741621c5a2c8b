"""Trajectories in annotated datasets (issue [5/6]): annotations whose conversations bring images at later turns
and name the trajectory they continue (`parent`, `fork_turn`) are converted and indexed as a user does it
(`packfeed convert ... --index`), become an index of trees (each fork's shared tokens and vision units, checked
against its parent), and are served by a real server with each shared turn and its images once: each trajectory,
laid out alone from the shared pack, is token for token and pixel for pixel what the server sends for it alone.
A fork that does not hold (other first turns, no such parent, fork_turn out of range) is served whole and
counted by reason."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from recipe_data import write_image

pytestmark = pytest.mark.slow

POLICY = ["--image-policy", "internvl", "--image-size", "56", "--max-tiles", "1", "--image-tokens", "4"]


def user(text: str, image: bool = False) -> dict:
    return {"from": "human", "value": ("<image>\n" if image else "") + text}


def gpt(text: str) -> dict:
    return {"from": "gpt", "value": text}


def annotations() -> list[dict]:
    """A tree: t0 (six turns, screenshots A, B, C at turns 0, 2, 4); t1 continues t0 after turn 2 with its own
    screenshot D; t2 continues t1 after its turn 4 (inherits A and D); t3 continues t0 after turn 4 (inherits A
    and B) with C2. Forks that do not hold, a group sharing one prompt, and text alone beside it."""
    t0 = [user("Open the settings.", True), gpt("click(10, 20)"), user("Now what?", True), gpt("type('wifi')"),
          user("Done?", True), gpt("Yes, done.")]
    t1 = t0[:2] + [user("The menu opened instead.", True), gpt("press('esc')"), user("And now?"),
                   gpt("click(30, 40)")]
    t2 = t1[:4] + [user("It closed."), gpt("Finished.")]
    t3 = t0[:4] + [user("A dialog appeared.", True), gpt("click('ok')")]
    rows = [{"id": "t0", "images": ["A.png", "B.png", "C.png"], "conversations": t0},
            {"id": "t1", "parent": "t0", "fork_turn": 2, "images": ["A.png", "D.png"], "conversations": t1},
            {"id": "t2", "parent": "t1", "fork_turn": 4, "images": ["A.png", "D.png"], "conversations": t2},
            {"id": "t3", "parent": "t0", "fork_turn": 4, "images": ["A.png", "B.png", "C2.png"], "conversations": t3},
            {"id": "other-turns", "parent": "t0", "fork_turn": 2, "images": ["A.png", "D.png"],
             "conversations": [user("Open the display settings.", True), *t1[1:]]},
            {"id": "no-parent", "parent": "t9", "fork_turn": 2, "images": ["A.png", "D.png"], "conversations": t1},
            {"id": "past-the-end", "parent": "t0", "fork_turn": 6, "images": ["A.png", "B.png", "C.png"],
             "conversations": t0 + [user("More?"), gpt("No.")]}]
    for k in range(3):  # one prompt's answers: a group (in an index of trees, each continues the first)
        rows.append({"id": f"g{k}", "group": "q", "images": ["A.png"],
                     "conversations": [user("What is on the screen?", True), gpt("A window. " * (k + 1))]})
    rows.append({"id": "text", "conversations": [user("Hello?"), gpt("Hi.")]})
    return rows


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    from packfeed.media.chat import PRESETS
    from packfeed.server.tools.demo import train_tokenizer

    root = tmp_path_factory.mktemp("trajectories")
    rng = np.random.default_rng(0)
    for name in ("A", "B", "C", "D", "C2"):
        write_image(root / "images" / f"{name}.png", rng, "PNG")
    rows = annotations()
    (root / "a.json").write_text(json.dumps(rows))
    tokenizer = train_tokenizer(root / "tokenizer.json", vocab_size=400,
                                special_tokens=PRESETS["internvl"].special_tokens)
    done = subprocess.run([sys.executable, "-m", "packfeed.cli", "convert", "llava", str(root / "a.json"),
                           "--out", str(root / "shards"), "--image-root", str(root / "images"), "--index",
                           "--tokenizer", str(tokenizer), *POLICY, "--quiet",
                           "--workers", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return root / "shards" / "index.parquet", rows, tokenizer


def turn_ends(tokenizer_path, ids: np.ndarray) -> list[int]:
    """Where each turn of a served sample ends, found by the test from the internvl template's markers: after
    each <|im_end|> and the newline separator."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    end, newline = tokenizer.token_to_id("<|im_end|>"), tokenizer.encode("\n", add_special_tokens=False).ids
    return [int(k) + 1 + len(newline) for k in np.flatnonzero(ids == end)]


def tiles_of(pack, k: int) -> list[np.ndarray]:
    """The tiles of sample k's images, in order."""
    mine = set(np.flatnonzero((pack.image_sample == k).numpy()).tolist())
    return [tile.numpy() for tile, image in zip(pack.tiles(), pack.tile_image.tolist()) if image in mine]


def served(index, **options):
    from packfeed.client import LocalServer, PackStream

    with LocalServer(index, workers=1) as server:
        stream = PackStream(server.target, job="trees", rank=0, dp=1, microbatches=1, seed=0, vision_cap=256,
                            token_cap=8192, **options)
        packs = [pack for step in stream for pack in step.packs if not pack.empty]
        stream.close()
    return packs


def test_an_index_of_annotated_trajectories_records_each_fork_checked(indexed):
    from packfeed.server.index.table import read_index_info

    index, rows, _ = indexed
    table = {row["key"]: row for row in pq.read_table(index).to_pylist()}
    place = {key: row["sample_id"] for key, row in table.items()}
    info = read_index_info(index)
    assert info.trees and info.groups
    assert info.forks_alone == {"first turns differ from the parent's (text, images or their tiles)": 1,
                                "fork_turn out of range: a fork shares its first 1 to n - 1 turns with a parent of "
                                "more turns": 1,
                                "parent not found: a trajectory continues an earlier sample, named by its id or key": 1}
    assert all(row["valid"] for row in table.values())  # a fork that does not hold is kept, whole
    assert {key: table[key]["parent"] for key in table} == {
        "t0": -1, "t1": place["t0"], "t2": place["t1"], "t3": place["t0"], "other-turns": -1, "no-parent": -1,
        "past-the-end": -1, "g0": -1, "g1": place["g0"], "g2": place["g0"], "text": -1}
    tree = {table[key]["group"] for key in ("t0", "t1", "t2", "t3")}
    assert len(tree) == 1 and tree != {-1} and table["g1"]["group"] == table["g0"]["group"] not in tree
    assert table["other-turns"]["group"] == -1 and table["text"]["group"] == -1
    one_tile = table["g0"]["vision_units"]  # every screenshot one tile here
    assert [table[key]["fork_vision"] for key in ("t1", "t2", "t3", "g1")] == [one_tile, 2 * one_tile,
                                                                               2 * one_tile, one_tile]
    # the tree's prompt (what one-level sharing would share): the turns all its trajectories share, A's turn
    assert {table[key]["prompt_vision"] for key in ("t0", "t1", "t2", "t3")} == {one_tile}
    done = subprocess.run([sys.executable, "-m", "packfeed.cli", "info", str(index)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "5 samples continue another, in 2 trees" in done.stdout and "3 naming a parent are served whole" in \
        done.stdout and "1 parent not found" in done.stdout


def test_a_tree_is_served_with_each_shared_turn_and_image_once(indexed):
    from packfeed.client.model.shared_prefix import shared, unshared

    index, rows, tokenizer = indexed
    images_of = {row["id"]: len(row.get("images", [])) for row in rows}
    packs, alone_packs = served(index), served(index, shared_prefix=False)
    alone = {}
    for pack in alone_packs:
        assert "shared_prefix" not in pack.tensors
        bounds = pack.cu_seqlens.tolist()
        for k, key in enumerate(pack.sample_keys):
            alone[key] = (pack.input_ids[bounds[k]:bounds[k + 1]].numpy(),
                          pack.labels[bounds[k]:bounds[k + 1]].numpy(), tiles_of(pack, k))
    assert sorted(alone) == sorted(images_of)
    (pack,) = [p for p in packs if "t0" in p.sample_keys]
    keys = pack.sample_keys
    assert {"t0", "t1", "t2", "t3"} <= set(keys)  # the tree fits the caps: one pack
    rows_ = {keys[k]: (keys[parent], size) for k, (parent, size) in enumerate(pack.shared_prefix.view(-1, 2).tolist())}
    ends = {key: turn_ends(tokenizer, alone[key][0]) for key in ("t0", "t1", "t3", "g0")}
    assert rows_["t1"] == ("t0", ends["t1"][1]) and rows_["t2"] == ("t1", ends["t1"][3])
    assert rows_["t3"] == ("t0", ends["t3"][3])
    for key in ("other-turns", "no-parent", "past-the-end", "text"):
        assert rows_.get(key, (key, 0))[0] == key  # served whole
    # the wire carries each of the tree's images once, with the turn that brought it
    own = {key: int((pack.image_sample == k).sum()) for k, key in enumerate(keys)}
    assert [own[key] for key in ("t0", "t1", "t2", "t3")] == [3, 1, 0, 1]
    # each trajectory laid out alone: what the server sends for it alone, token for token, pixel for pixel
    whole = unshared(pack)
    bounds = whole.cu_seqlens.tolist()
    for k, key in enumerate(keys):
        ids, labels, pixels = alone[key]
        assert np.array_equal(whole.input_ids[bounds[k]:bounds[k + 1]].numpy(), ids), key
        assert np.array_equal(whole.labels[bounds[k]:bounds[k + 1]].numpy(), labels), key
        mine = tiles_of(whole, k)
        assert int((whole.image_sample == k).sum()) == images_of[key] and len(mine) == len(pixels), key
        assert all(np.array_equal(a, b) for a, b in zip(mine, pixels)), key
    laid = shared(pack)
    assert int(laid.input_ids.numel()) == sum(len(alone[key][0]) for key in keys) - sum(
        size - 1 for key, (parent, size) in rows_.items() if parent != key)
