"""Routing a phase's balanced bins to ranks (OrchMLLM's node-wise rearrangement, Alg. 3; `phases` balances the
bins): the bins are interchangeable, so which rank runs which is free: choose it to move as few bytes between
nodes as possible, then as few between ranks. Pure functions of their inputs."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

EXACT_RANKS = 512  # a linear assignment of R bins to R ranks costs O(R^3)


@dataclass(frozen=True)
class Routing:
    """Where each bin runs, and the bytes its outputs move to their consumers."""

    rank_of_bin: np.ndarray
    total_bytes: float  # every output not consumed on its own rank
    inter_node_bytes: float
    inter_node_bound: float  # no placement moves fewer bytes between nodes
    exact: bool


def route(bin_of_item: np.ndarray, consumer_of_item: np.ndarray, item_bytes: np.ndarray, ranks: int,
          ranks_per_node: int) -> Routing:
    """The rank of every bin: fewest bytes between nodes first, then fewest between ranks."""
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, not {ranks_per_node}")
    volume = np.bincount(np.asarray(bin_of_item) * ranks + np.asarray(consumer_of_item),
                         np.asarray(item_bytes, float), minlength=ranks * ranks).reshape(ranks, ranks)  # bin -> rank
    node_of_rank, projection = _nodes(ranks, ranks_per_node)
    total = volume.sum()
    if projection.shape[1] == 1 and ranks <= EXACT_RANKS:  # one node: only bytes between ranks to save
        from scipy.optimize import linear_sum_assignment

        bins, chosen = linear_sum_assignment(volume, maximize=True)
        rank_of_bin = np.empty(ranks, dtype=np.int64)
        rank_of_bin[bins] = chosen
        return Routing(rank_of_bin, float(total - volume[bins, chosen].sum()), 0.0, 0.0, True)
    per_node = volume @ projection  # bin -> bytes consumed on each node
    bound = total - per_node.max(axis=1).sum()
    if ranks <= EXACT_RANKS:
        from scipy.optimize import linear_sum_assignment

        # lexicographic: bytes leaving the node dominate; bytes leaving the rank break ties
        leaving_node = total - per_node[:, node_of_rank]
        leaving_rank = total - volume
        bins, chosen = linear_sum_assignment(leaving_node * (total + 1.0) + leaving_rank)
        rank_of_bin = np.empty(ranks, dtype=np.int64)
        rank_of_bin[bins] = chosen
        exact = True
    else:
        rank_of_bin = _greedy_route(volume, per_node, node_of_rank)
        exact = False
    kept_rank = volume[np.arange(ranks), rank_of_bin].sum()
    kept_node = per_node[np.arange(ranks), node_of_rank[rank_of_bin]].sum()
    return Routing(rank_of_bin, float(total - kept_rank), float(total - kept_node), float(bound), exact)


@functools.lru_cache(maxsize=16)
def _nodes(ranks: int, ranks_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """Each rank's node (the last node may hold fewer ranks), and the rank -> node 0/1 matrix."""
    node_of_rank = np.arange(ranks) // ranks_per_node
    nodes = int(node_of_rank[-1]) + 1 if ranks else 0
    return node_of_rank, np.eye(nodes)[node_of_rank]


def _greedy_route(volume: np.ndarray, per_node: np.ndarray, node_of_rank: np.ndarray) -> np.ndarray:
    """Bins to nodes by bytes kept (largest first, while the node has room), then within each node bins to
    ranks by bytes kept on the rank."""
    ranks, nodes = per_node.shape
    room = np.bincount(node_of_rank, minlength=nodes)
    node_of_bin = np.full(ranks, -1)
    for flat in np.argsort(-per_node, axis=None, kind="stable"):
        b, n = divmod(int(flat), nodes)
        if node_of_bin[b] < 0 and room[n] > 0:
            node_of_bin[b], room[n] = n, room[n] - 1
    rank_of_bin = np.empty(ranks, dtype=np.int64)
    for n in range(nodes):
        members = np.flatnonzero(node_of_bin == n)
        free = np.flatnonzero(node_of_rank == n).tolist()
        for b in members[np.argsort(-volume[members][:, free].max(axis=1), kind="stable")]:
            best = max(free, key=lambda r: (volume[b, r], -r))
            rank_of_bin[b] = best
            free.remove(best)
    return rank_of_bin
