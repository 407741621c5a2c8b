"""Multi-turn trajectories put into a live job (docs/live.md "Trajectories"): a sample's turns, each with who
produced it (only the policy's are trained), its tokens and the images it brings; and a trajectory continuing
another of its group from a turn on (a fork), which holds that one's first turns and carries images for its own
turns only. Checked at the put: the turns cover the tokens, each turn's image placeholders match the images it
brings (a refusal names the turn), and a fork starts with exactly its parent's turns (their tokens' digest) and
inherits its parent's images there, costed as it would be alone."""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

from packfeed.server.live.refused import Refused
from packfeed.v1 import packfeed_pb2 as pb

ROLES = {pb.TURN_ROLE_POLICY: "policy", pb.TURN_ROLE_ENVIRONMENT: "environment", pb.TURN_ROLE_TOOL: "tool",
         pb.TURN_ROLE_USER: "user", pb.TURN_ROLE_SYSTEM: "system"}
MAX_TURNS = 1024

Turn = tuple[int, int, int]  # (role, tokens, images)


def checked_turns(message, sample: Any) -> tuple[Turn, ...]:
    """The sample's turns as (role, tokens, images), checked: they cover its tokens, each turn has a role, only the
    policy's turns hold loss tokens, and its image files are those of its own turns (from `fork_turn` on)."""
    turns = tuple((int(t.role), int(t.tokens), int(t.images)) for t in message.turns)
    if not turns:
        if message.parent or message.fork_turn:
            raise Refused("turns", "a trajectory continuing another (parent, fork_turn) gives its turns")
        return ()
    if len(turns) > MAX_TURNS:
        raise Refused("turns", f"{len(turns)} turns: at most {MAX_TURNS}")
    ends = np.cumsum([tokens for _, tokens, _ in turns])
    if int(ends[-1]) != len(sample.tokens) or any(tokens == 0 for _, tokens, _ in turns):
        raise Refused("turns", f"its turns hold {int(ends[-1])} tokens, each at least 1; the sample has "
                               f"{len(sample.tokens)}: the turns cover its tokens exactly, in order")
    for k, (role, _, _) in enumerate(turns):
        if role not in ROLES:
            raise Refused(f"turns[{k}]", f"role {role}: give who produced the turn ({', '.join(ROLES.values())})")
        if role != pb.TURN_ROLE_POLICY and sample.loss_mask[ends[k] - turns[k][1]:ends[k]].any():
            raise Refused(f"turns[{k}]", f"a {ROLES[role]} turn holds loss tokens: only the policy's turns are "
                                         "trained (loss_mask 0 on every other turn)")
    fork = int(message.fork_turn)
    if message.parent and not 1 <= fork < len(turns):
        raise Refused("fork_turn", f"{fork}: a trajectory continuing another shares its first 1 to "
                                   f"{len(turns) - 1} turns (it has {len(turns)}) and has turns of its own")
    if not message.parent and fork:
        raise Refused("fork_turn", "give the parent it forks from, or no fork_turn")
    own = sum(images for _, _, images in turns[fork:])
    if own != len(sample.images) and not sample.prompt:
        raise Refused("images", f"its turns from turn {fork} on bring {own} images and it carries "
                                f"{len(sample.images)} image files: give one file per image of its own turns "
                                "(a fork's earlier turns' images are its parent's)")
    return turns


def check_placeholders(turns: tuple[Turn, ...], starts: np.ndarray, lengths: np.ndarray, costs: list[int],
                       context_id: int) -> None:
    """Each turn's placeholder runs (of the whole trajectory, `starts` and `lengths`; `costs`: the placeholders its
    images need, in order) lie in it and match the images it brings; a refusal names the first turn that does
    not."""
    bounds = np.r_[0, np.cumsum([tokens for _, tokens, _ in turns])]
    taken = 0
    for k, (_, _, images) in enumerate(turns):
        inside = (starts >= bounds[k]) & (starts < bounds[k + 1])
        found = lengths[inside].tolist()
        crossing = bool(((starts[inside] + lengths[inside]) > bounds[k + 1]).any())
        wanted = costs[taken:taken + images]
        if crossing or found != wanted:
            raise Refused(f"turns[{k}]", f"turn {k} brings {images} images, which need placeholder runs (of token "
                                         f"{context_id}) {wanted}; it holds {found}"
                                         + (" and one runs past its end" if crossing else ""))
        taken += images


def turn_digests(tokens: np.ndarray, turns: tuple[Turn, ...]) -> tuple[str, ...]:
    """Per turn, the digest of the tokens up to its end (and of the turns so far): what a fork at the next turn
    must start with."""
    hasher, out, start = xxhash.xxh3_128(), [], 0
    for role, count, images in turns:
        hasher.update(np.ascontiguousarray(tokens[start:start + count], dtype="<i4").tobytes())
        hasher.update(np.asarray([role, count, images], dtype="<i8").tobytes())
        out.append(hasher.copy().hexdigest())
        start += count
    return tuple(out)


def inherit(sample: Any, parent: Any) -> list[tuple[int, int]]:
    """A fork's parent found in its group: its first turns are the parent's (the same tokens and turns; Refused
    where they are not, or where the parent is not of its group). Sets the tokens and images it shares; returns
    the sizes of the images it inherits (its parent's first ones)."""
    fork = sample.fork_turn
    if parent.group != sample.group:
        raise Refused("parent", f"{sample.parent!r} answers group {parent.group!r}, this trajectory {sample.group!r}: "
                                "a tree of trajectories is one group")
    if len(parent.turns) < fork + 1 or parent.turn_digests[fork - 1] != sample.turn_digests[fork - 1]:
        raise Refused("parent", f"its first {fork} turns are not those of {sample.parent!r} (tokens and turns): a "
                                "fork starts with exactly its parent's turns")
    inherited = sum(images for _, _, images in sample.turns[:fork])
    sample.fork_tokens = sum(tokens for _, tokens, _ in sample.turns[:fork])
    sample.inherited_images = inherited
    return list(parent.sizes)[:inherited]
