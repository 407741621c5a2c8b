"""The interface every trained model offers (`LayerModel`: a flat list of layers a pipeline can cut anywhere), what
a microbatch's cost depends on (`Features`), and what a model adds to train its encoder apart
(`SeparableEncoder`, `VisionSplit`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from packfeed.trainer.batch import Microbatches, StepShape


@dataclass(frozen=True)
class Features:
    """What a (padded) microbatch costs depend on."""

    tiles: int
    tokens: int
    square: float  # sum of squared sample lengths, the padding tail counted as one more sample


def features_of_carrier(carrier) -> Features:
    """Features of a first-stage carrier (pixels, input_ids, position_ids, cu_seqlens, ...)."""
    pixels, input_ids, _, cu_seqlens = carrier[:4]
    bounds = cu_seqlens.long().tolist()
    lengths = np.diff(bounds + [input_ids.numel()])
    return Features(int(pixels.shape[0]), int(input_ids.numel()), float((lengths.astype(np.float64) ** 2).sum()))


def pack_features(pack, token_slots: int) -> Features:
    """Features of one client pack as a whole model computes it (`token_slots`: its tokens, padding included;
    its tiles or patches; padding counted as one more sample, as in a carrier)."""
    bounds = pack.cu_seqlens.long().tolist()
    lengths = np.diff(bounds + [max(token_slots, bounds[-1])]).astype(np.float64)
    return Features(int(pack.tile_shapes.shape[0]), int(token_slots), float((lengths ** 2).sum()))


class LayerModel(Protocol):
    """A model as consecutive layers, each mapping one tuple of tensors (its carrier) to the next."""

    kinds: list[str]  # per layer: vision_embed, vit, projector, text_embed, llm or head
    layers: nn.ModuleList

    @property
    def n_layers(self) -> int: ...

    def describe(self) -> str: ...

    def inputs(self, step, token_multiple: int = 64, dp: int = 1, collate: str = "packed") -> Microbatches:
        """A step's packs padded into the first stage's fixed-shape microbatches (`collate="padded"`: each
        pack's samples as a padded batch, the baseline packing is measured against)."""

    def carrier(self, before_layer: int, shape: StepShape, device: torch.device | str = "meta",
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
        """Empty tensors shaped like what enters `before_layer` (n_layers: the head's output)."""

    def features(self, carrier: tuple[torch.Tensor, ...]) -> Features:
        """What one first-stage microbatch's cost depends on (for the simulator and the cost model)."""


@dataclass(frozen=True)
class VisionSplit:
    """How a model's vision encoder separates from its LLM (`parallel.encoder=bubbles`): the encoder is layers
    0:encoder_layers; its input (pixels) and output (features) divide by vision unit (tile) along an axis, with a
    fixed number of entries per unit."""

    encoder_layers: int
    input_axis: int
    output_axis: int
    output_per_unit: int


class SeparableEncoder(Protocol):
    """What a LayerModel adds to train with its encoder in the pipeline's bubbles."""

    vision: VisionSplit

    def vision_units(self, microbatch: tuple[torch.Tensor, ...]) -> int:
        """Real (not padding) vision units of one first-stage microbatch; they come first."""

    def vision_input(self, microbatch: tuple[torch.Tensor, ...]) -> torch.Tensor: ...

    def vision_input_like(self, units: int, device: torch.device) -> torch.Tensor: ...

    def vision_output_like(self, units: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor: ...

    def encoder_carrier(self, pixels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The carrier entering layer 0 for these units alone."""

    def encoder_output(self, carrier: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The features in the carrier the encoder's last layer returns."""

    def llm_carrier(self, microbatch: tuple[torch.Tensor, ...], features: torch.Tensor,
                    shape: StepShape) -> tuple[torch.Tensor, ...]:
        """The carrier entering the first LLM layer: the microbatch's real units' features, padded."""

    def without_samples(self, microbatch: tuple[torch.Tensor, ...], samples: set[int]) -> tuple[torch.Tensor, ...]:
        """parallel.encoder=phases: the microbatch with these samples left out of the loss."""
