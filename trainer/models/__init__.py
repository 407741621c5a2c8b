"""The models the trainer trains, each as a flat list of layers a pipeline can cut anywhere (`LayerModel`):
the reference VLM (`reference`, its inputs in `reference_inputs`) and `transformers` VLMs of the supported
families (`hf`). The pipeline, partition search, adaptive recompute, profiling and checkpoints only ever see
this interface, so the same code trains both."""

from __future__ import annotations

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


def build_model(config, conventions: Any, device: torch.device) -> LayerModel:
    """The model `config` (the trainer's `model` section) names, sized for the dataset's conventions."""
    if config.hf:
        from packfeed.trainer.models.hf.model import HFLayerModel
        from packfeed.trainer.models.hf.build import attention_implementation

        return HFLayerModel(config.hf, conventions, dict(config.hf_config),
                            attention_implementation(config.hf_attention, device, packed=True), config.seed)
    from packfeed.trainer.data import sized_model

    return ReferenceModel(sized_model(config, conventions))
