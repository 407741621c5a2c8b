"""Multi-turn trajectories for the tree tests, built here turn by turn from a family dataset's real packs: an
observation turn is a real sample's prompt with its images (not trained), an action turn random tokens (trained).
Each trajectory is also built alone, as a one-sample pack with every image of its turns: the side the tree is
compared with, made without the code under test."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hf_models import packs_of
from packfeed.client.stream.tensors import IGNORE_INDEX, PackTensors

ITEM_TENSORS = ("visual_kind", "frame_seconds")


@dataclass(frozen=True)
class Turn:
    ids: torch.Tensor  # int32
    trained: bool
    images: tuple = ()  # (offset in the turn, placeholders, tiles, {item tensor: value})


@dataclass
class Trajectory:
    turns: list[Turn]
    parent: int = -1  # the trajectory it forks from (-1: a root, or alone)
    fork: int = 0  # the turns it shares with its parent
    tensors: dict = field(default_factory=dict)  # token.NAME -> (L,) float32

    @property
    def ids(self) -> torch.Tensor:
        return torch.cat([turn.ids for turn in self.turns])

    def shared_tokens(self) -> int:
        return sum(len(turn.ids) for turn in self.turns[:self.fork])


def observation(pack: PackTensors) -> Turn:
    """A one-sample pack's prompt (every token before its first loss token) with its images, as a turn."""
    prompt = int(torch.nonzero(pack.labels != IGNORE_INDEX)[0])
    tiles = pack.tiles()
    images = []
    for j, (start, n) in enumerate(pack.image_token_spans.view(-1, 2).tolist()):
        assert start + n <= prompt
        images.append((start, n, tuple(t for t, item in zip(tiles, pack.tile_image.tolist()) if item == j),
                       {name: pack.tensors[name][j] for name in ITEM_TENSORS if name in pack.tensors}))
    return Turn(pack.input_ids[:prompt].clone(), False, tuple(images))


def action(rng: np.random.Generator, vocab: int, avoid: set[int], length: int) -> Turn:
    allowed = np.array([t for t in range(10, vocab) if t not in avoid])
    return Turn(torch.tensor(rng.choice(allowed, length), dtype=torch.int32), True)


def alone(trajectory: Trajectory, step_loss: int) -> PackTensors:
    """The trajectory as a one-sample pack, each of its turns' images in it."""
    return concatenated([trajectory], [0], step_loss)


def concatenated(trajectories: list[Trajectory], skip_before: list[int], step_loss: int,
                 rows: list[list[int]] | None = None) -> PackTensors:
    """One pack of the trajectories whole; trajectory k's images before its token skip_before[k] left out (its
    parent's, on the wire), with `rows` as its shared_prefix."""
    ids, labels, positions, bounds = [], [], [], [0]
    names = sorted(trajectories[0].tensors)
    per_token = {name: [] for name in names}
    spans, image_sample, tile_image, shapes, pixels = [], [], [], [], []
    items = {name: [] for name in ITEM_TENSORS}
    for k, trajectory in enumerate(trajectories):
        offset = bounds[-1]
        turn_start = 0
        for turn in trajectory.turns:
            for start, n, tiles, item in turn.images:
                if turn_start + start >= skip_before[k]:
                    spans.append([offset + turn_start + start, n])
                    image_sample.append(k)
                    tile_image += [len(spans) - 1] * len(tiles)
                    shapes += [list(t.shape) for t in tiles]
                    pixels += [t.reshape(-1) for t in tiles]
                    for name, value in item.items():
                        items[name].append(value)
            ids.append(turn.ids)
            labels.append(turn.ids if turn.trained else torch.full_like(turn.ids, IGNORE_INDEX))
            turn_start += len(turn.ids)
        positions.append(torch.arange(turn_start, dtype=torch.int32))
        for name in names:
            per_token[name].append(trajectory.tensors[name])
        bounds.append(offset + turn_start)
    tensors = {"input_ids": torch.cat(ids), "labels": torch.cat(labels).to(torch.int32),
               "position_ids": torch.cat(positions), "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
               "image_token_spans": torch.tensor(spans, dtype=torch.int32).view(-1, 2),
               "image_sample": torch.tensor(image_sample, dtype=torch.int32),
               "tile_image": torch.tensor(tile_image, dtype=torch.int32),
               "tile_shapes": torch.tensor(shapes, dtype=torch.int32).view(-1, 3),
               "pixels": torch.cat(pixels) if pixels else torch.zeros(0, dtype=torch.uint8),
               **{f"token.{name}": torch.cat(values) for name, values in per_token.items()}}
    for name, values in items.items():
        if values:
            tensors[name] = torch.stack(values)
    if rows is not None:
        tensors["shared_prefix"] = torch.tensor(rows, dtype=torch.int32)
    loss = int((tensors["labels"] != IGNORE_INDEX).sum())
    return PackTensors(0, 0, 0, 0, False, [f"t{k}" for k in range(len(trajectories))], loss, step_loss, [], tensors)


def tree_of_turns(data, seed: int = 0) -> list[Trajectory]:
    """Trajectories of up to six turns (observation, action, x3), images at turns 0, 2 and 4: a tree forking at two
    depths (t1 and t4 from t0 at turn 2, t2 from t0 at turn 4, t3 from t1 at turn 4, t6 from t2 at turn 2: within
    what t2 shares with t0) and t5 alone. Observations are the dataset's samples with images (two at turn 0, one
    or two at 2 and 4), each trajectory's turns its own after its fork."""
    rng = np.random.default_rng(seed)
    one_sample = packs_of(data, [[k] for k in range(10)])
    with_images = [p for p in one_sample if p.image_sample.numel()]
    image_ids = {int(t) for p in with_images for t in p.input_ids[p.image_token_spans[:, 0].long()]}

    def act() -> Turn:
        return action(rng, data.vocab, image_ids, int(rng.integers(3, 9)))

    def obs() -> Turn:
        return observation(with_images[int(rng.integers(len(with_images)))])

    two_images = next(p for p in with_images if p.image_sample.numel() == 2)
    t0 = [observation(two_images), act(), obs(), act(), obs(), act()]
    t1 = t0[:2] + [obs(), act(), obs(), act()]
    t4 = t0[:2] + [obs(), act(), obs(), act()]
    t2 = t0[:4] + [obs(), act()]
    t3 = t1[:4] + [obs(), act()]
    t5 = [obs(), act(), obs(), act()]
    t6 = t2[:2] + [obs(), act()]
    out = [Trajectory(t0), Trajectory(t1, 0, 2), Trajectory(t2, 0, 4), Trajectory(t3, 1, 4), Trajectory(t4, 0, 2),
           Trajectory(t5), Trajectory(t6, 2, 2)]
    for trajectory in out:  # each its own advantages and old log-probabilities, shared turns included
        length = len(trajectory.ids)
        trajectory.tensors = {"advantages": torch.from_numpy(rng.normal(size=length).astype("float32")),
                              "old_logprobs": torch.from_numpy(rng.normal(-2.0, 0.1, size=length).astype("float32"))}
    return out


def tree_packs(trajectories: list[Trajectory]) -> tuple[PackTensors, list[PackTensors]]:
    """(the wire pack of the trajectories: full tokens each, images after each fork only, shared_prefix rows of
    (parent, shared tokens); a root naming itself), the trajectories each alone as one-sample packs."""
    step_loss = sum(int(sum(len(t.ids) for t in trajectory.turns if t.trained)) for trajectory in trajectories)
    rows = []
    for k, trajectory in enumerate(trajectories):
        if trajectory.parent >= 0:
            rows.append([trajectory.parent, trajectory.shared_tokens()])
        else:
            children = [t.shared_tokens() for t in trajectories if t.parent == k]
            rows.append([k, max(children, default=0)])
    skip = [trajectory.shared_tokens() for trajectory in trajectories]
    wire = concatenated(trajectories, skip, step_loss, rows)
    return wire, [alone(trajectory, step_loss) for trajectory in trajectories]

