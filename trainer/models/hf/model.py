"""`HFLayerModel`: a `transformers` VLM of a supported family as the trainer's flat layer list.

    vision embed ─ vision block × n ─ merger / projector ─ text embed ─ decoder layer × m ─ norm + head → loss

The layers hold the model's own submodules (`packfeed.trainer.models.hf.layers`), so the weights, their
initialisation and the arithmetic are the model's; the pipeline, the partition search and adaptive recompute
work on this list exactly as on the reference model's. What each boundary carries is named per layer
(`carrier_names`), and `carrier` makes empty tensors of those shapes for a step's sizes, from which pipeline
stages are built without running the model.

Not trained here: layers the model computes and then discards (LLaVA's vision layers after
`vision_feature_layer`, CLIP's post-norm); they are left out of the list.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from packfeed.trainer.batch import Microbatches, StepShape
from packfeed.trainer.models.layer_model import Features, VisionSplit
from packfeed.trainer.models.hf import layers as L
from packfeed.trainer.models.hf.build import build_hf_model

META = ("input_ids", "positions", "bounds", "labels", "vision_positions")
TEXT = ("hidden", "positions", "bounds", "labels")
QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
FLOAT = torch.float32


class HFLayerModel:
    """A family's model built from the dataset's conventions, cut into layers; also builds its inputs."""

    def __init__(self, family: str, conventions: Any, sizes: dict | None = None, attention: str = "sdpa",
                 seed: int = 0, model: nn.Module | None = None):
        self.family, self.conventions = family, conventions
        self.hf = model if model is not None else build_hf_model(family, conventions, sizes, attention, seed)
        config = self.hf.config
        self.text_config = config.get_text_config()
        self.vision_config = config.vision_config
        self.kinds: list[str] = []
        self.names: list[tuple[str, ...]] = []  # carrier names entering each layer, and the head's output
        modules = self._qwen_vision() if family in QWEN else self._tile_vision()
        modules += self._language()
        self.layers = nn.ModuleList(modules)
        self.names.append(("loss",))
        fqn = {id(p): name for name, p in self.hf.named_parameters()}
        self.parameter_names = [{local: fqn[id(p)] for local, p in layer.named_parameters(remove_duplicate=False)}
                                for layer in self.layers]
        from packfeed.trainer.models.hf.inputs import InputBuilder

        self.builder = InputBuilder(self)

    # --- building the list ---------------------------------------------------------------------------------
    def _add(self, kind: str, layer: L.CarrierLayer) -> L.CarrierLayer:
        self.kinds.append(kind)
        self.names.append(layer.inputs)
        return layer

    def _qwen_vision(self) -> list[nn.Module]:
        visual, variant = self.hf.model.visual, self.family
        deepstack = list(getattr(self.vision_config, "deepstack_visual_indexes", None) or [])
        window = ("window_bounds", "window_index") if variant == "qwen2_5_vl" else ()
        interp = ("interp_indices", "interp_weights") if variant == "qwen3_vl" else ()
        vision = ("hidden", "patch_positions", "vision_bounds") + window
        current = ("pixels", "patch_positions", "vision_bounds") + window + interp + META
        out = [self._add("vision_embed", L.QwenVisionEmbed(visual, current, vision + META, variant))]
        current = vision + META
        full = set(getattr(self.vision_config, "fullatt_block_indexes", None) or [])
        for b in range(len(visual.blocks)):
            slot = deepstack.index(b) if b in deepstack else None
            after = vision + (("deepstack",) if any(d <= b for d in deepstack) else ()) + META
            windowed = variant == "qwen2_5_vl" and b not in full
            out.append(self._add("vit", L.QwenVisionBlock(visual, b, current, after, windowed, slot)))
            current = after
        self.deepstack_layers = len(deepstack)
        features = ("features",) + (("deepstack",) if deepstack else ()) + META
        out.append(self._add("projector", L.QwenMerger(visual, current, features, variant)))
        return out

    def _tile_vision(self) -> list[nn.Module]:
        self.deepstack_layers = 0
        config, model = self.hf.config, self.hf.model
        tower = model.vision_tower
        feature_layer = config.vision_feature_layer
        if not isinstance(feature_layer, int) or feature_layer >= 0:
            raise ValueError(f"{self.family}: vision_feature_layer {feature_layer!r} is not supported in the pipeline; "
                             "use a single negative layer index (the released checkpoints use -1 or -2)")
        drop_class = config.vision_feature_select_strategy == "default"
        current, vision = ("pixels",) + META, ("hidden",) + META
        if self.family == "internvl":
            blocks = tower.encoder.layer
            embed = L.TileVisionEmbed(tower.embeddings, current, vision)
            final_norm = tower.layernorm if feature_layer == -1 else None
            projector = L.TileProjector(model.multi_modal_projector, vision, ("features",) + META, drop_class,
                                        final_norm, model.pixel_shuffle, config.downsample_ratio)
        else:  # llava: CLIP's hidden_states[k] is the output of its (n + 1 + k)-th layer, after the pre-norm
            blocks = tower.encoder.layers
            embed = L.TileVisionEmbed(tower.embeddings, current, vision, tower.pre_layrnorm)
            projector = L.TileProjector(model.multi_modal_projector, vision, ("features",) + META, drop_class)
        used = len(blocks) + 1 + feature_layer
        out = [self._add("vision_embed", embed)]
        for b in range(used):
            out.append(self._add("vit", L.TileVisionBlock(blocks[b], vision, vision, self.family == "llava")))
        out.append(self._add("projector", projector))
        return out

    def _language(self) -> list[nn.Module]:
        language = self.hf.model.language_model
        stack = ("vision_positions", "deepstack") if self.deepstack_layers else ()
        current = ("features",) + (("deepstack",) if self.deepstack_layers else ()) + META
        out = [self._add("text_embed", L.TextEmbed(language.embed_tokens, current, TEXT + stack))]
        current = TEXT + stack
        mrope = self.family in QWEN
        for i, block in enumerate(language.layers):
            after = TEXT + (stack if i + 1 < self.deepstack_layers else ())
            out.append(self._add("llm", L.DecoderLayer(block, language.rotary_emb, current, after, mrope,
                                                       i < self.deepstack_layers)))
            current = after
        out.append(self._add("head", L.Head(language.norm, self.hf.lm_head, current)))
        return out

    # --- what the trainer asks of a model --------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def describe(self) -> str:
        vision = sum(p.numel() for layer, kind in zip(self.layers, self.kinds) if kind in ("vision_embed", "vit",
                                                                                         "projector")
                     for p in layer.parameters())
        total = sum(p.numel() for p in {id(p): p for layer in self.layers for p in layer.parameters()}.values())
        return (f"{self.family}: {len(self.layers)} layers ({self.kinds.count('vit')} vision blocks, "
                f"{self.kinds.count('llm')} decoder layers), {total:,} parameters ({vision:,} in vision)")

    def inputs(self, step, token_multiple: int = 64, dp: int = 1, collate: str = "packed") -> Microbatches:
        return self.builder.microbatches(step, token_multiple, dp, collate)

    def carrier(self, before_layer: int, shape: StepShape, device: torch.device | str = "meta",
                dtype: torch.dtype = FLOAT) -> tuple[torch.Tensor, ...]:
        """Empty tensors shaped like what enters layer `before_layer` (= n_layers: the head's output)."""
        return tuple(torch.empty(*size, dtype=kind if kind is not FLOAT else dtype, device=device)
                     for size, kind in (self._spec(name, before_layer, shape) for name in self.names[before_layer]))

    def _spec(self, name: str, layer: int, s: StepShape) -> tuple[tuple[int, ...], torch.dtype]:
        text, vision = self.text_config.hidden_size, self._vision_width()
        long, i32 = torch.int64, torch.int32
        kind = self.kinds[layer] if layer < len(self.kinds) else "end"
        qwen = self.family in QWEN
        sizes = {
            "input_ids": ((1, s.tokens), long), "labels": ((1, s.tokens), long),
            "positions": ((1, 4 if qwen else 1, s.tokens), long), "bounds": ((1, s.samples + 2), i32),
            "vision_positions": ((1, s.vision_tokens), long), "loss": ((1,), FLOAT),
            "patch_positions": ((1, s.tiles, 2), long), "vision_bounds": ((1, s.vision_segments), i32),
            "window_bounds": ((1, s.window_segments), i32),
            "window_index": ((1, s.tiles // self.merge_unit), long),
            "interp_indices": ((1, s.tiles, 4), long), "interp_weights": ((1, s.tiles, 4), FLOAT),
            "features": ((1, s.vision_tokens, text), FLOAT),
        }
        if name in sizes:
            return sizes[name]
        if name == "pixels":
            return ((1, s.tiles, self.builder.patch_features), FLOAT) if qwen else \
                ((1, s.tiles, 3, self.builder.tile_size, self.builder.tile_size), FLOAT)
        if name == "deepstack":
            return (1, self._deepstack_depth(layer), s.vision_tokens, text), FLOAT
        if name == "hidden" and kind in ("vit", "projector"):
            return ((1, s.tiles, vision), FLOAT) if qwen else ((1, s.tiles, self.builder.tile_tokens, vision), FLOAT)
        if name == "hidden":
            return (1, s.tokens, text), FLOAT
        raise KeyError(name)

    def _deepstack_depth(self, layer: int) -> int:
        """DeepStack features in the carrier entering `layer`: made so far (vision), or not yet added (text)."""
        kind = self.kinds[layer]
        if kind in ("vit", "projector"):
            vits = [i for i, k in enumerate(self.kinds) if k == "vit"]
            done = sum(1 for i in vits if i < layer)
            indexes = self.vision_config.deepstack_visual_indexes
            return sum(1 for b in indexes if b < done)
        if kind == "text_embed":
            return self.deepstack_layers
        llm = self.kinds[:layer].count("llm")
        return self.deepstack_layers - llm

    def _vision_width(self) -> int:
        config = self.vision_config
        return getattr(config, "embed_dim", None) if self.family == "qwen2_vl" else config.hidden_size

    @property
    def merge_unit(self) -> int:
        return self.vision_config.spatial_merge_size ** 2 if self.family in QWEN else 1

    # --- SeparableEncoder (tile families): pixels (1, tiles, 3, S, S) -> features (1, tiles x tokens, D) ---------
    @property
    def vision(self) -> VisionSplit | None:
        """Tile families only: a Qwen tower's patches attend within their image under per-image geometry, so its
        work does not divide by patch."""
        if self.family in QWEN:
            return None
        return VisionSplit(self.kinds.index("text_embed"), 1, 1, self.builder.tokens_per_tile)

    def vision_units(self, microbatch: tuple[torch.Tensor, ...]) -> int:
        named = dict(zip(self.names[0], microbatch))
        return int((named["vision_positions"] >= 0).sum()) // self.builder.tokens_per_tile

    def vision_input(self, microbatch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return dict(zip(self.names[0], microbatch))["pixels"]

    def vision_input_like(self, units: int, device: torch.device) -> torch.Tensor:
        size = self.builder.tile_size
        return torch.empty(1, units, 3, size, size, dtype=FLOAT, device=device)

    def vision_output_like(self, units: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        tokens = units * self.builder.tokens_per_tile
        return torch.empty(1, tokens, self.text_config.hidden_size, dtype=dtype, device=device)

    def encoder_carrier(self, pixels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        unused = torch.zeros(1, 0, dtype=torch.int64, device=pixels.device)  # the vision layers pass these on
        return (pixels,) + (unused,) * len(META)

    def encoder_output(self, carrier: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return carrier[0]

    def llm_carrier(self, microbatch: tuple[torch.Tensor, ...], features: torch.Tensor,
                    shape: StepShape) -> tuple[torch.Tensor, ...]:
        named = dict(zip(self.names[0], microbatch))
        padding = features.new_zeros(1, shape.vision_tokens - features.shape[1], features.shape[2])
        named["features"] = torch.cat([features, padding], dim=1)
        return tuple(named[name] for name in self.names[self.vision.encoder_layers])

    def features(self, carrier: tuple[torch.Tensor, ...]) -> Features:
        """What a first-stage microbatch costs depend on (tiles or patches, tokens, squared sample lengths)."""
        named = dict(zip(self.names[0], carrier))
        bounds = named["bounds"].reshape(-1).long()
        lengths = (bounds[1:] - bounds[:-1]).double()
        return Features(int(named["pixels"].shape[1]), int(named["input_ids"].numel()), float((lengths ** 2).sum()))
