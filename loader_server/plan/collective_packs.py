"""Collective-safe packs (`packfeed.server.plan.collective`): before an epoch's packs are arranged, each class of
towers whose pack count is not a multiple of dp gets one: its lightest pairs merged within the caps, else packs
split so each half still calls the class's towers, else its tower samples moved into its other packs. Then the
class fills whole columns of dp packs. Pure functions of their inputs."""

from __future__ import annotations

import heapq

import numpy as np

from packfeed.server.plan.collective import class_counts


def merge_to_whole_columns(packs, pack_class: np.ndarray, vision_cap: int, token_cap: int, dp: int):
    """Fewer packs left over: for each class whose pack count is not a multiple of dp (r over one), merge r pairs
    of its lightest packs, each within the caps, so its count becomes one. A class with fewer than dp packs, or
    whose pairs would exceed a cap, is left as it is (its leftovers share columns). Returns (packs, pack_class)
    (`packs`: an `IsfPacks`; the same objects when nothing merges)."""
    into = np.arange(len(pack_class))  # the pack each pack's members end in
    for cls in class_counts(pack_class)[0]:
        ids = np.flatnonzero(pack_class == cls)
        spare = len(ids) % dp
        if not spare or len(ids) < dp:
            continue
        lightest = ids[np.lexsort((ids, packs.tokens[ids]))[:2 * spare]]
        first, second = lightest[:spare], lightest[2 * spare - 1:spare - 1:-1]  # lightest with heaviest of them
        fits = ((packs.vision[first] + packs.vision[second] <= vision_cap)
                & (packs.tokens[first] + packs.tokens[second] <= token_cap))
        if len(second) == spare and fits.all():
            into[second] = first
    if np.array_equal(into, np.arange(len(into))):
        return packs, pack_class
    kept = np.flatnonzero(into == np.arange(len(into)))
    renumber = np.full(len(into), -1, dtype=np.int64)
    renumber[kept] = np.arange(len(kept))
    sizes = np.diff(packs.offsets)
    member_pack = np.repeat(renumber[into], sizes)
    order = np.argsort(member_pack, kind="stable")  # each kept pack's members, then those merged into it
    offsets = np.zeros(len(kept) + 1, dtype=packs.offsets.dtype)
    np.cumsum(np.bincount(member_pack, minlength=len(kept)), out=offsets[1:])
    vision = np.bincount(renumber[into], weights=packs.vision, minlength=len(kept)).astype(packs.vision.dtype)
    tokens = np.bincount(renumber[into], weights=packs.tokens, minlength=len(kept)).astype(packs.tokens.dtype)
    return type(packs)(packs.members[order], offsets, vision, tokens), pack_class[kept]


CANDIDATES = 32  # packs tried per split or move: enough where one exists, and planning stays linear in packs


def split_to_whole_columns(packs, pack_class: np.ndarray, towers: np.ndarray, vision: np.ndarray,
                           tokens: np.ndarray, dp: int, caps):
    """What merging left: each class of towers whose pack count is still not a multiple of dp (merging its
    lightest pairs would exceed a cap, or it has fewer packs than dp) gets one pack more at a time, up to the next
    multiple, by splitting in two its pack with the most samples whose samples can be halved so that each half
    still calls all of the class's towers (the rest go to the lighter half by tokens). Halves hold fewer samples
    than their pack, so they keep its caps. The class then fills whole
    columns. A class that runs out of such packs first is left as it was (its leftovers share columns and are
    counted as unaligned). Class 0 (no tower) is never split: a column of it calls nothing on any rank.
    Where no pack of the class can be halved so, its count goes down to a multiple instead: a pack's tower
    samples move into another of the class's packs with room under `caps`, and what stays calls no tower.
    `towers`: every sample's class; `vision`, `tokens`: every sample's. Returns (packs, pack_class)."""
    distinct, counts = class_counts(pack_class)
    if not np.any((distinct != 0) & (counts % dp != 0)):
        return packs, pack_class  # every tower class fills whole columns already (the common case)
    pieces, classes = _Pieces(packs.members, packs.offsets), {}  # what changes, over the packs as they are
    sizes = np.diff(packs.offsets).astype(np.int64)
    calls = np.bincount(np.repeat(np.arange(len(sizes)), sizes), weights=towers[packs.members] != 0,
                        minlength=len(sizes)).astype(np.int64)  # each pack's samples that call a tower
    changed = False
    for cls, count in zip(distinct, counts):
        need = -int(count) % dp
        if cls == 0 or not need:
            continue
        ids = np.flatnonzero(pack_class == cls)
        trial, added = {}, []  # the packs split so far (their halves), and the new packs
        # the packs calling towers from the most samples first (ties: the most samples); one that cannot be halved
        # is not tried again, and after CANDIDATES such in a row the class stops splitting. At most
        # (need + 1) x (CANDIDATES + 1) packs are ever taken, so only as many of the first are queued.
        first = ids[np.lexsort((ids, -sizes[ids], -calls[ids]))[:(need + 1) * (CANDIDATES + 1)]]
        queue = [(-int(calls[p]), -int(sizes[p]), int(p)) for p in first]
        heapq.heapify(queue)
        failures = 0
        while need and queue and failures < CANDIDATES:
            _, _, p = heapq.heappop(queue)
            members = trial[p] if p in trial else pieces[p]
            halves = _halves(members, towers[members].astype(np.int64), int(cls), tokens)
            if halves is None:
                failures += 1
                continue
            key = -1 - len(added)  # a new pack, appended after the others
            trial[p], trial[key] = halves
            added.append(key)
            for half in (p, key):
                heapq.heappush(queue, (-int(np.count_nonzero(towers[trial[half]] != 0)), -len(trial[half]), half))
            failures, need = 0, need - 1
        if need:  # no more packs to split: fewer, by moving tower samples into the class's other packs instead
            if _moved(pieces, classes, ids.tolist(), int(cls), towers, vision, tokens, caps, dp):
                changed = True
            continue
        for p, members in trial.items():
            if p >= 0:
                pieces[p] = members
        for key in added:
            classes[pieces.append(trial[key])] = int(cls)
        changed = True
    if not changed:
        return packs, pack_class
    members, offsets = pieces.assembled()
    pack_class = np.concatenate([pack_class, np.zeros(len(pieces.added), np.int64)])
    for p, cls in classes.items():
        pack_class[p] = cls
    pack_class = pack_class[np.diff(offsets) > 0]  # a pack whose every sample moved is gone
    offsets = offsets[np.concatenate([[True], np.diff(offsets) > 0])]
    starts = offsets[:-1]
    sums = lambda values: np.add.reduceat(values[members].astype(np.int64), starts).astype(values.dtype)  # noqa: E731
    return type(packs)(members, offsets, sums(vision), sums(tokens)), pack_class


class _Pieces:
    """Packs' members as `split_to_whole_columns` edits them: a pack's own slice until it is replaced, packs
    appended after the others; built into (members, offsets) once, without a list of every pack."""

    def __init__(self, members: np.ndarray, offsets: np.ndarray):
        self.members, self.offsets = members, offsets
        self.replaced: dict[int, np.ndarray] = {}
        self.added: list[np.ndarray] = []

    def __getitem__(self, p: int) -> np.ndarray:
        n = len(self.offsets) - 1
        if p >= n:
            return self.added[p - n]
        return self.replaced[p] if p in self.replaced else self.members[self.offsets[p]:self.offsets[p + 1]]

    def __setitem__(self, p: int, members: np.ndarray) -> None:
        n = len(self.offsets) - 1
        if p >= n:
            self.added[p - n] = members
        else:
            self.replaced[p] = members

    def append(self, members: np.ndarray) -> int:
        """Adds a pack; returns its id."""
        self.added.append(members)
        return len(self.offsets) - 1 + len(self.added) - 1

    def assembled(self) -> tuple[np.ndarray, np.ndarray]:
        """(members, offsets) of every pack in id order, emptied packs as empty ranges."""
        lengths = np.diff(self.offsets).astype(np.int64)
        for p, piece in self.replaced.items():
            lengths[p] = len(piece)
        lengths = np.concatenate([lengths, [len(piece) for piece in self.added]]).astype(np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=self.offsets.dtype)
        np.cumsum(lengths, out=offsets[1:])
        n = len(self.offsets) - 1
        own = np.ones(len(lengths), dtype=bool)  # the packs left as they were: their members, in order
        own[list(self.replaced)] = False
        own[n:] = False
        members = np.empty(int(offsets[-1]), dtype=self.members.dtype)
        members[np.repeat(own, lengths)] = self.members[np.repeat(own[:n], np.diff(self.offsets))]
        for p, piece in [*self.replaced.items(), *((n + k, piece) for k, piece in enumerate(self.added))]:
            members[offsets[p]:offsets[p + 1]] = piece
        return members, offsets


def _moved(pieces: _Pieces, classes: dict, ids: list[int], cls: int, towers, vision, tokens, caps, dp: int) -> bool:
    """One pack fewer of class `cls`, `len(ids) % dp` times: a pack's tower samples (lightest first) move into
    another pack of the class with room under the caps for them, made where needed by moving that pack's
    heaviest samples without a tower back the other way; what stays of the first pack calls no tower (class 0).
    All or none: False (and nothing changed) when the class runs out of such moves."""
    trial = {p: pieces[p] for p in ids}

    def keys(p: int) -> tuple:  # (its tower samples' tokens: lightest source first; vision, then the tokens it
        members = trial[p]  # can give back: the roomiest target first)
        calling = towers[members] != 0
        return int(tokens[members[calling]].sum()), int(vision[members].sum()), -int(tokens[members[~calling]].sum())

    known = {p: keys(p) for p in trial}
    emptied = []
    for _ in range(len(ids) % dp):
        swap = None
        roomiest = sorted(trial, key=lambda p: (known[p][1], known[p][2], p))[:CANDIDATES + 1]
        for source in sorted(trial, key=lambda p: (known[p][0], p))[:CANDIDATES]:
            calling = trial[source][towers[trial[source]] != 0]
            for target in [p for p in roomiest if p != source][:CANDIDATES]:
                back = _room(trial[target], calling, trial[source], towers, vision, tokens, caps)
                if back is not None:
                    swap = source, target, calling, back
                    break
            if swap:
                break
        if swap is None:
            return False
        source, target, calling, back = swap
        trial[target] = np.sort(np.concatenate([np.setdiff1d(trial[target], back), calling]))
        known[target] = keys(target)
        left = trial.pop(source)
        del known[source]
        emptied.append((source, np.sort(np.concatenate([left[towers[left] == 0], back]))))
    for p, members in trial.items():
        pieces[p] = members
    for source, members in emptied:
        pieces[source], classes[source] = members, 0  # an empty piece is dropped with the others
    return True


def _room(target: np.ndarray, calling: np.ndarray, source: np.ndarray, towers, vision, tokens, caps):
    """Samples without a tower of `target` (heaviest first, as few as will do) whose leaving makes room for
    `calling` under the caps and which fit where `calling` leaves `source`; None where there are none."""
    if vision[target].sum() + vision[calling].sum() > caps.vision_cap:
        return None
    need = int(tokens[target].sum() + tokens[calling].sum()) - caps.token_cap
    free = caps.token_cap - int(tokens[source].sum() - tokens[calling].sum())
    plain = target[towers[target] == 0]
    back = plain[np.argsort(-tokens[plain].astype(np.int64), kind="stable")]
    taken = np.searchsorted(np.cumsum(tokens[back].astype(np.int64)), need) + 1 if need > 0 else 0
    if taken > len(back) or int(tokens[back[:taken]].sum()) > free:
        return None
    return back[:taken]


def _halves(members: np.ndarray, classes: np.ndarray, cls: int, tokens: np.ndarray):
    """A pack's samples in two halves that each call all of `cls`'s towers (None when greedy finds none):
    samples by decreasing number of towers, then tokens, each to the half it adds more missing towers to, else
    to the lighter half."""
    if len(members) < 2:
        return None
    halves: list[list[int]] = [[], []]
    called, load = [0, 0], [0, 0]
    bits = np.array([bin(int(c)).count("1") for c in classes])
    for k in np.lexsort((np.arange(len(members)), -tokens[members].astype(np.int64), -bits)):
        gains = [bin(int(classes[k]) & ~called[side]).count("1") for side in (0, 1)]
        side = 0 if gains[0] > gains[1] else 1 if gains[1] > gains[0] else int(load[1] < load[0])
        halves[side].append(int(members[k]))
        called[side] |= int(classes[k])
        load[side] += int(tokens[members[k]])
    if called != [cls, cls]:
        return None
    return np.asarray(sorted(halves[0]), dtype=members.dtype), np.asarray(sorted(halves[1]), dtype=members.dtype)
