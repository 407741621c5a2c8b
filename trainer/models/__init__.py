"""The models the trainer trains, each as a flat list of layers a pipeline can cut anywhere (`LayerModel`):
the reference VLM (`reference`, its inputs in `reference_inputs`) and `transformers` VLMs of the supported
families (`hf`). The pipeline, partition search, adaptive recompute, profiling and checkpoints only ever see
this interface (`layer_model`), so the same code trains both. Each model comes in named sizes (`flavors`).
A `transformers` model can also run whole, as its library runs it (`hf.whole`)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from packfeed.trainer.batch import Microbatches, StepShape
from packfeed.trainer.models.layer_model import Features, LayerModel, VisionSplit, features_of_carrier


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

        return HFLayerModel(config.hf, conventions, config.hf_sizes,
                            attention_implementation(config.hf_attention, device, packed=True), config.seed)
    from packfeed.trainer.models.reference import sized_model

    sized = sized_model(config, conventions)
    if device.type == "cuda" and sized.llm_ffn % 8:
        warnings.warn(f"the reference LLM's SwiGLU is {sized.llm_ffn} wide, not a multiple of 8: bf16 matrix products "
                      "on tensor cores run slow unaligned kernels (2.4x slower at the 2b flavor's size); set "
                      "model.ffn_multiple=256 (the 2b flavor's)", stacklevel=2)
    return ReferenceModel(sized)
