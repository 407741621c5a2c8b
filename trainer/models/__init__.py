"""The models the trainer trains, each as a flat list of layers a pipeline can cut anywhere (`LayerModel`):
the reference VLM (`reference`, its inputs in `reference_inputs`) and `transformers` VLMs of the supported
families (`hf`). The pipeline, partition search, adaptive recompute, profiling and checkpoints only ever see
this interface, so the same code trains both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from packfeed.trainer.batch import Microbatches, StepShape
from packfeed.trainer.simulate.calibrated import Features


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


class ReferenceModel:
    """The reference VLM (`packfeed.trainer.models.reference`) behind the `LayerModel` interface."""

    def __init__(self, config):
        from packfeed.trainer.models.reference import build_layers, layer_kinds

        self.config = config
        self.kinds = layer_kinds(config)
        self.layers = build_layers(config)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def describe(self) -> str:
        c = self.config
        return (f"reference VLM: {c.tile_size} px tiles, {c.tokens_per_tile} tokens per tile, vocabulary "
                f"{c.vocab_size}, {c.vit_layers} ViT + {c.llm_layers} LLM blocks")

    def inputs(self, step, token_multiple: int = 64, dp: int = 1, collate: str = "packed") -> Microbatches:
        from packfeed.trainer.models.reference_inputs import microbatches_of

        if collate != "packed":
            raise ValueError("data.collate=padded is for Hugging Face models (model.hf); the reference model packs")

        return microbatches_of(step, self.config, token_multiple)

    def carrier(self, before_layer: int, shape: StepShape, device: torch.device | str = "meta",
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
        from packfeed.trainer.models.reference import example_carrier

        return example_carrier(self.config, before_layer, shape.tokens, shape.tiles, shape.samples, device, dtype)

    def features(self, carrier: tuple[torch.Tensor, ...]) -> Features:
        from packfeed.trainer.simulate.calibrated import features_of_carrier

        return features_of_carrier(carrier)

    # --- SeparableEncoder: pixels (tiles, 3, S, S) -> features (tiles, tokens_per_tile, D) -------------------
    @property
    def vision(self) -> VisionSplit:
        return VisionSplit(self.kinds.index("text_embed"), 0, 0, 1)

    def vision_units(self, microbatch: tuple[torch.Tensor, ...]) -> int:
        return int((microbatch[4] >= 0).sum()) // self.config.tokens_per_tile

    def vision_input(self, microbatch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return microbatch[0]

    def vision_input_like(self, units: int, device: torch.device) -> torch.Tensor:
        c = self.config
        return torch.empty(units, 3, c.tile_size, c.tile_size, dtype=torch.uint8, device=device)

    def vision_output_like(self, units: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(units, self.config.tokens_per_tile, self.config.llm_dim, dtype=dtype, device=device)

    def encoder_carrier(self, pixels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        unused = torch.zeros(0, dtype=torch.int64, device=pixels.device)  # the vision layers pass these on
        return (pixels,) + (unused,) * 5

    def encoder_output(self, carrier: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return carrier[0]

    def llm_carrier(self, microbatch: tuple[torch.Tensor, ...], features: torch.Tensor,
                    shape: StepShape) -> tuple[torch.Tensor, ...]:
        padding = features.new_zeros(shape.tiles - features.shape[0], *features.shape[1:])
        return (torch.cat([features, padding]), *microbatch[1:])

    def without_samples(self, microbatch: tuple[torch.Tensor, ...], samples: set[int]) -> tuple[torch.Tensor, ...]:
        """The microbatch with the labels of its samples `samples` ignored (routed images that never came)."""
        from packfeed.trainer.models.reference import IGNORE_INDEX

        labels, bounds = microbatch[5].clone(), microbatch[3].tolist()
        for sample in samples:
            labels[bounds[sample]:bounds[sample + 1]] = IGNORE_INDEX
        return (*microbatch[:5], labels)


def build_model(config, conventions: Any, device: torch.device) -> LayerModel:
    """The model `config` (the trainer's `model` section) names, sized for the dataset's conventions."""
    if config.hf:
        from packfeed.trainer.models.hf.model import HFLayerModel
        from packfeed.trainer.models.hf.build import attention_implementation

        return HFLayerModel(config.hf, conventions, dict(config.hf_config),
                            attention_implementation(config.hf_attention, device, packed=True), config.seed)
    from packfeed.trainer.data import sized_model

    return ReferenceModel(sized_model(config, conventions))
