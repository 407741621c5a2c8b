"""A rank's step as the pipeline sees it: fixed-shape microbatches and the shape the other stages must know.

torch.distributed.pipelining sends activations of one shape for every microbatch of a schedule, so a model's
input builder (`packfeed.trainer.models`) pads the M packs of a step to the step's largest (tokens rounded up to
`token_multiple`, tiles or patches, samples, vision tokens...) and concatenates them along dim 0; the schedule
splits them back into M equal chunks. With balanced packs the padding is the small slack ISF leaves under its
caps; with random batches it is the padding a padded batch pays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SIZE_FIELDS = ("tokens", "tiles", "samples", "vision_tokens", "vision_segments", "window_segments")
HEADER_FIELDS = SIZE_FIELDS + ("step_loss_tokens", "epoch", "step", "last_in_epoch", "stop")


@dataclass(frozen=True)
class StepShape:
    """Per-microbatch padded sizes of one step, plus what the other stages must know about it. `tiles` counts
    the vision tower's input units (tiles, or Qwen's patches); the sizes after it are 0 where a model has none."""

    tokens: int
    tiles: int
    samples: int
    step_loss_tokens: int
    epoch: int = 0
    step: int = 0
    last_in_epoch: bool = False
    stop: bool = False
    vision_tokens: int = 0  # LLM positions the vision features fill
    vision_segments: int = 0  # Qwen: the vision tower's attention bounds (frames + 1)
    window_segments: int = 0  # Qwen2.5-VL: its window-attention bounds

    def header(self) -> torch.Tensor:
        return torch.tensor([int(getattr(self, name)) for name in HEADER_FIELDS], dtype=torch.int64)

    @classmethod
    def of_header(cls, header: torch.Tensor) -> StepShape:
        values = dict(zip(HEADER_FIELDS, header.tolist()))
        return cls(**{k: (bool(v) if k in ("last_in_epoch", "stop") else int(v)) for k, v in values.items()})

    @property
    def key(self) -> tuple[int, ...]:
        return tuple(int(getattr(self, name)) for name in SIZE_FIELDS)


@dataclass(frozen=True)
class RoutedImages:
    """One microbatch of a routed step (plan strategy isf+phases, `packfeed.server.serve.routed`): the images this
    rank encodes for microbatch m of any rank, and where the images of its own pack m are encoded. An image is
    named by (consumer rank, microbatch, planned position of its sample, its number in the sample) on both sides."""

    encode_input: torch.Tensor  # the encoder's input units (tiles) of the images encoded here, image after image
    encoded: list[tuple[int, int, int, int]]  # per image encoded here: (consumer rank, position, number, units)
    consumed: list[tuple[int, int, int, int, int]]  # per image of the pack: (encoder rank, position, number,
    # units, sample index in the pack)


@dataclass
class Microbatches:
    """The step's M microbatches concatenated along dim 0 (the first stage's inputs) and its shape."""

    shape: StepShape
    args: tuple[torch.Tensor, ...]
    real_tokens: int
    real_tiles: int
    samples_by_dataset: dict[str, int] = field(default_factory=dict)  # of this replica's packs
    routed: list[RoutedImages] | None = None  # per microbatch, when the step's images are routed (isf+phases)

    def microbatch(self, m: int, count: int) -> tuple[torch.Tensor, ...]:
        """Microbatch m of `count`, as the schedule splits it."""
        return tuple(a.tensor_split(count)[m] for a in self.args)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple if multiple > 1 else value
