"""Trees of trajectories in length files (docs/planning.md "Trees"): a grouped record (`group`,
`prefix_tokens`: its prompt, what one-level sharing shares) may give an `id` and name the record of its group it
continues (`parent`, an earlier record of the same file) with `fork_tokens`, the tokens it shares with it, and
`fork_vit_num`, the vision units of those tokens' images; `prompt_vit_num` is its prompt's vision units (default
its `vit_num`: every image in the prompt, as a one-level group's). Such a file makes an index of trees
(`TREE_COLUMNS`), which `packfeed plan`, `stats` and `simulate` plan by unique tokens (docs/planning.md "Trees")."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TREE_FIELDS = ("id", "parent", "fork_tokens", "fork_vit_num", "prompt_vit_num")


def record_trees(path: Path, records: list, group: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """Per record (parent's position in the file (-1: none), fork tokens, fork vision units, prompt vision units),
    checked; None when no record names a parent."""
    if not any(isinstance(r, dict) and "parent" in r for r in records):
        return None
    n = len(records)
    parent = np.full(n, -1, np.int64)
    fork_tokens, fork_vision, prompt_vision = (np.zeros(n, np.int64) for _ in range(3))
    place: dict = {}
    for k, record in enumerate(records):
        def refuse(what: str) -> ValueError:
            return ValueError(f"{path}: record {k}: {what}")

        if "id" in record:
            if record["id"] in place or isinstance(record["id"], bool) or not isinstance(record["id"], (str, int)):
                raise refuse(f"'id' {record['id']!r}: give each record a string or integer id of its own")
            place[record["id"]] = k
        given = record.get("prompt_vit_num", record["vit_num"])
        if not _count(given, 0, record["vit_num"]):
            raise refuse(f"'prompt_vit_num' is {given!r}: an integer from 0 to its vit_num ({record['vit_num']})")
        prompt_vision[k] = given
        if record.get("parent") is None:
            continue
        p = place.get(record["parent"])
        if p is None or group[p] != group[k] or group[k] < 0:
            raise refuse(f"'parent' {record['parent']!r} is no earlier record of its group {record.get('group')!r}: "
                         "a trajectory continues one of its own tree, given before it")
        tokens, vision = record.get("fork_tokens"), record.get("fork_vit_num", 0)
        top_tokens = min(record["token_num"], records[p]["token_num"])
        if not _count(tokens, 2, top_tokens):
            raise refuse(f"'fork_tokens' is {tokens!r}: the tokens it shares with its parent, an integer from 2 to "
                         f"{top_tokens}")
        top_vision = min(record["vit_num"], records[p]["vit_num"])
        if not _count(vision, 0, top_vision):
            raise refuse(f"'fork_vit_num' is {vision!r}: the vision units of what it shares, from 0 to {top_vision}")
        parent[k], fork_tokens[k], fork_vision[k] = p, tokens, vision
    return parent, fork_tokens, fork_vision, prompt_vision


def _count(value, low: int, high: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and low <= value <= high


def joined_trees(found: list[tuple[np.ndarray, ...] | None], sizes: list[int]) -> tuple[np.ndarray, ...] | None:
    """The trees of several files' records, in order (a parent's position over all of them), or None when no file
    has any; a file without trees adds records continuing nothing."""
    if all(f is None for f in found):
        return None
    offsets = np.r_[0, np.cumsum(sizes)]
    parts = []
    for f, n, offset in zip(found, sizes, offsets):
        if f is None:
            f = (np.full(n, -1, np.int64), *(np.zeros(n, np.int64) for _ in range(3)))
        parts.append((np.where(f[0] >= 0, f[0] + offset, -1), *f[1:]))
    return tuple(np.concatenate([part[k] for part in parts]) for k in range(4))


def with_trees(loads, trees: tuple[np.ndarray, ...] | None, prompt_tokens: np.ndarray | None):
    """`loads` (grouped) planned as trees: each fork continuing its parent; the prompt kept for the one-level
    comparison (`packfeed.server.plan.trees.one_level`)."""
    if trees is None:
        return loads
    parent, fork_tokens, fork_vision, prompt_vision = trees
    loads.parent, loads.prefix = parent, fork_tokens.astype(np.int32)
    loads.shared_vision = fork_vision.astype(np.int32)
    loads.prompt, loads.prompt_vision = np.asarray(prompt_tokens, np.int32), prompt_vision.astype(np.int32)
    return loads
