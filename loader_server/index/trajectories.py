"""Trees of trajectories in annotated datasets (docs/planning.md "Trees"): a sample whose JSON names a `parent`
(an earlier sample, by its JSON `id` or else its key) and a `fork_turn` k continues that sample from its turn k
on: its first k turns are the parent's (the same text, images and placeholders). Each sample stays whole in its
shard, images of the shared turns too, so any tool reads it alone; Packfeed plans and serves its shared turns
once, with its parent's.

Indexing records, per sample of two or more turns, where each turn ends in its tokens, the vision units up to
there and a digest of everything up to there (`turn_record`); once every shard is read, `link_trees` checks
each fork against its parent and makes the index of trees (`TREE_COLUMNS`). A fork that does not hold (no such
earlier sample, other first turns, a video, too few turns) is planned and served whole, and counted by reason
in the index's `forks_alone`: nothing is lost, and the report says why it shares nothing."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import xxhash

from packfeed.media.conversation import IMAGE_TAG

# the row fields a sample's turns leave for `link_trees` (kept in the index's parts, not in the index)
TURN_FIELDS = {"doc_id": pa.string(), "parent_ref": pa.string(), "fork_turn": pa.int32(),
               "turn_ends": pa.list_(pa.int32()), "turn_vision": pa.list_(pa.int32()),
               "turn_digests": pa.list_(pa.uint64())}


def fork_request(document: Any) -> dict[str, Any]:
    """What a sample's JSON says of its place in a tree: its `id`, the `parent` it continues and its `fork_turn`
    (as given; `link_trees` judges them)."""
    if not isinstance(document, dict):
        return {}
    given = {"doc_id": document.get("id"), "parent_ref": document.get("parent")}
    out = {name: str(value) for name, value in given.items()
           if isinstance(value, (str, int)) and not isinstance(value, bool)}
    if document.get("parent") is not None:
        out.setdefault("parent_ref", "")  # named, but not an id: refused by link_trees
        fork = document.get("fork_turn")
        out["fork_turn"] = fork if isinstance(fork, int) and not isinstance(fork, bool) and fork < 1 << 30 else -1
    return out


def turn_record(turns: list[dict[str, str]], ends: list[int], ids: np.ndarray, image_units: list[int],
                image_shapes: list[Any], image_checksums: list[int]) -> dict[str, Any]:
    """Per turn of a sample of images (no videos): where it ends in the ids, the vision units of the images up to
    there, and a digest of the ids, images (content and tiles) and turns up to there."""
    if len(turns) < 2:
        return {}
    hasher, taken, start, units = xxhash.xxh3_64(), 0, 0, 0
    vision, digests = [], []
    for turn, end in zip(turns, ends):
        count = turn["value"].count(IMAGE_TAG)
        hasher.update(np.ascontiguousarray(ids[start:end], dtype="<i4").tobytes())
        hasher.update(repr((turn["role"], image_checksums[taken:taken + count],
                            image_shapes[taken:taken + count])).encode())
        units += int(sum(image_units[taken:taken + count]))
        taken, start = taken + count, end
        vision.append(units)
        digests.append(hasher.intdigest())
    return {"turn_ends": list(ends), "turn_vision": vision, "turn_digests": digests}


def link_trees(rows: list[dict[str, Any]]) -> tuple[dict[str, np.ndarray] | None, Counter]:
    """Check every fork of `rows` (all the index's, in order) against its parent; the index's TREE_COLUMNS
    ({name: values}; None when no fork holds) and the forks served whole, counted by reason. A tree becomes one
    group (each member's `group_key` and `prefix_tokens`: what all its trajectories share); in an index of trees a
    group sharing one prompt is a tree too, each member continuing the group's first one."""
    parent = np.full(len(rows), -1, np.int64)
    fork_tokens, fork_vision = np.zeros(len(rows), np.int64), np.zeros(len(rows), np.int64)
    by_id, by_key, alone = {}, {}, Counter()
    for k, row in enumerate(rows):
        if "parent_ref" in row and row["parent_ref"] is not None and row["valid"]:
            found = _parent_of(row, by_id, by_key, rows)
            if isinstance(found, str):
                alone[found] += 1
            else:
                fork = row["fork_turn"]
                parent[k], fork_tokens[k] = found, row["turn_ends"][fork - 1]
                fork_vision[k] = row["turn_vision"][fork - 1]
        if row.get("doc_id") is not None:
            by_id.setdefault(row["doc_id"], []).append(k)
        by_key[row["key"]] = k
    if not (parent >= 0).any():
        return None, alone
    prompt_vision = _as_trees(rows, parent, fork_tokens, fork_vision)
    return {"parent": parent, "fork_tokens": fork_tokens, "fork_vision": fork_vision,
            "prompt_vision": prompt_vision}, alone


def _parent_of(row: dict[str, Any], by_id: dict, by_key: dict, rows: list) -> int | str:
    """The earlier sample a fork continues (its position), or why it is served whole."""
    ref, fork = row["parent_ref"], row["fork_turn"]
    named = by_id.get(ref, [])
    if len(named) > 1:
        return "parent id repeated: give each sample a trajectory continues an id of its own"
    p = named[0] if named else by_key.get(ref)
    if p is None:
        return "parent not found: a trajectory continues an earlier sample, named by its id or key"
    if not rows[p]["valid"]:
        return "parent invalid in the index"
    if not row.get("turn_digests") or not rows[p].get("turn_digests"):
        return "a trajectory with videos, or of one turn, is read whole"
    if not 1 <= fork < min(len(row["turn_ends"]), len(rows[p]["turn_ends"])):
        return "fork_turn out of range: a fork shares its first 1 to n - 1 turns with a parent of more turns"
    if row["turn_digests"][fork - 1] != rows[p]["turn_digests"][fork - 1]:
        return "first turns differ from the parent's (text, images or their tiles)"
    if row["turn_ends"][fork - 1] < 2:
        return "shares under 2 tokens"
    return p


def _as_trees(rows: list[dict[str, Any]], parent: np.ndarray, fork_tokens: np.ndarray,
              fork_vision: np.ndarray) -> np.ndarray:
    """Each tree (samples linked by forks) one group named by its root, its `prefix_tokens` the turns all its
    trajectories share; samples sharing one prompt (`group_key`) outside trees continue their group's first one.
    Sets `parent`, `fork_tokens`, `fork_vision` of those; returns each member's prompt vision units."""
    root = np.arange(len(rows))
    for k in np.flatnonzero(parent >= 0):  # parents come first: a parent's root is known
        root[k] = root[parent[k]]
    in_tree = np.zeros(len(rows), bool)
    in_tree[root[parent >= 0]] = True
    in_tree[parent >= 0] = True
    common: dict[int, int] = {}  # per tree, the turns every trajectory of it shares
    for k in np.flatnonzero(parent >= 0):
        common[root[k]] = min(common.get(root[k], 1 << 30), rows[k]["fork_turn"])
    prompt_vision = np.zeros(len(rows), np.int64)
    first: dict[str, int] = {}
    for k, row in enumerate(rows):
        if in_tree[k]:
            turns = common[int(root[k])]
            row["group_key"] = f"tree\0{rows[root[k]]['key']}"
            row["prefix_tokens"], prompt_vision[k] = row["turn_ends"][turns - 1], row["turn_vision"][turns - 1]
        elif row.get("group_key"):
            owner = first.setdefault(row["group_key"], k)
            prompt_vision[k] = row["vision_units"]
            if owner != k:
                parent[k], fork_tokens[k], fork_vision[k] = owner, row["prefix_tokens"], row["vision_units"]
    return prompt_vision
