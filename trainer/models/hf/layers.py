"""A `transformers` VLM as a flat list of layers, the way the reference model is built, without editing
`transformers`: each layer holds the model's own submodules (a vision block, the merger, the embedding, a
decoder layer, the final norm and head) and calls them exactly as the model's `forward` does.

Every layer maps one tuple of tensors (its "carrier") to the next. A carrier's tensors are named
(`packfeed.trainer.models.hf.carriers`): a layer turns its input tuple into a dict by its input names, and
hands on the tuple of its output names, so whatever a later stage needs (M-RoPE positions, the packed samples'
bounds, where the image features go, the loss labels, DeepStack features) crosses the stage boundary with the
activations. Every tensor has a leading dimension of 1 (one packed row): a pipeline schedule concatenates a
step's microbatches along it and splits them back.

Attention inside a pack is per sample: decoder layers get the packed bounds as the variable-length kwargs
(`cu_seq_lens_q/k`), which flash-attention 2 reads on CUDA and Packfeed's kernel reads on CPU; vision blocks
get their own per-image (per-frame, per-window) bounds, as the vision tower computes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from packfeed.client.model.attention import VARLEN_ATTENTION
from packfeed.client.model.shared_prefix import continued_segments

IGNORE_INDEX = -100


class CarrierLayer(nn.Module):
    """Base: named inputs in, named outputs out."""

    def __init__(self, inputs: Sequence[str], outputs: Sequence[str]):
        super().__init__()
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)

    def forward(self, *carrier: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(carrier) != len(self.inputs):
            raise ValueError(f"{type(self).__name__} takes {self.inputs}, got {len(carrier)} tensors")
        values = self.run(dict(zip(self.inputs, carrier)))
        return tuple(values[name] for name in self.outputs)

    def run(self, c: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError


def segments(bounds: torch.Tensor) -> torch.Tensor:
    """Packed bounds without the zero-length segments their padding repeats (vision attention splits on them)."""
    return torch.unique_consecutive(bounds)


def varlen_kwargs(bounds: torch.Tensor) -> dict:
    """The variable-length attention kwargs of a packed row whose samples end at `bounds` (the last is the row's
    length, so padding is a segment of its own)."""
    bounds = bounds.to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max()) if bounds.numel() > 1 else 0
    return {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest, "max_length_k": longest}


def vision_places(c: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Which vision features are real (not padding), and where in the row each real one goes."""
    places = c["vision_positions"][0]
    real = places >= 0
    return real, places[real]


def first(output):
    return output[0] if isinstance(output, tuple) else output


# --- Qwen2-VL, Qwen2.5-VL, Qwen3-VL vision towers ------------------------------------------------------------

class QwenVisionEmbed(CarrierLayer):
    """Patch embedding (+ Qwen3-VL's interpolated learned positions; Qwen2.5-VL's window order)."""

    def __init__(self, visual: nn.Module, inputs, outputs, variant: str):
        super().__init__(inputs, outputs)
        self.patch_embed = visual.patch_embed
        self.pos_embed = visual.pos_embed if variant == "qwen3_vl" else None
        self.variant = variant
        self.merge_unit = visual.spatial_merge_size ** 2

    def run(self, c):
        hidden = self.patch_embed(c["pixels"][0])
        if self.pos_embed is not None:  # Qwen3-VL: the learned table resampled to each image's grid
            weights = c["interp_weights"][0]
            hidden = hidden + (self.pos_embed(c["interp_indices"][0]) * weights[:, :, None]).sum(1).to(hidden.dtype)
        if self.variant == "qwen2_5_vl":  # merge units in window order (the positions came reordered)
            length = hidden.shape[0]
            hidden = hidden.reshape(length // self.merge_unit, self.merge_unit, -1)[c["window_index"][0]]
            hidden = hidden.reshape(length, -1)
        return {**c, "hidden": hidden[None]}


class QwenVisionBlock(CarrierLayer):
    """One vision block over every image's patches; Qwen2.5-VL's blocks outside `fullatt_block_indexes` attend
    within windows; a Qwen3-VL DeepStack block also hands its merged features to the LLM."""

    def __init__(self, visual: nn.Module, index: int, inputs, outputs, windowed: bool, deepstack_slot: int | None):
        super().__init__(inputs, outputs)
        self.block, self.rotary = visual.blocks[index], visual.rotary_pos_emb
        self.windowed = windowed
        self.deepstack = visual.deepstack_merger_list[deepstack_slot] if deepstack_slot is not None else None

    def run(self, c):
        hidden = c["hidden"][0]
        position_embeddings = self.rotary(hidden, c["patch_positions"][0])
        bounds = c["window_bounds" if self.windowed else "vision_bounds"][0]
        hidden = self.block(hidden, cu_seqlens=segments(bounds), position_embeddings=position_embeddings)
        out = {**c, "hidden": hidden[None]}
        if self.deepstack is not None:
            feature = self.deepstack(hidden)[None, None]
            out["deepstack"] = feature if "deepstack" not in c else torch.cat([c["deepstack"], feature], dim=1)
        return out


class QwenMerger(CarrierLayer):
    """The patch merger: 2 x 2 patches -> one LLM token (Qwen2.5-VL: back from window order)."""

    def __init__(self, visual: nn.Module, inputs, outputs, variant: str):
        super().__init__(inputs, outputs)
        self.merger, self.variant = visual.merger, variant

    def run(self, c):
        features = self.merger(c["hidden"][0])
        if self.variant == "qwen2_5_vl":
            features = features[torch.argsort(c["window_index"][0])]
        return {**c, "features": features[None]}


# --- InternVL (InternViT) and LLaVA (CLIP) vision towers: tiles of one size, batched ------------------------

class TileVisionEmbed(CarrierLayer):
    """Patch + class + position embeddings of every tile (CLIP: and its pre-norm)."""

    def __init__(self, embeddings: nn.Module, inputs, outputs, pre_norm: nn.Module | None = None):
        super().__init__(inputs, outputs)
        self.embeddings, self.pre_norm = embeddings, pre_norm

    def run(self, c):
        hidden = self.embeddings(c["pixels"][0])
        if self.pre_norm is not None:
            hidden = self.pre_norm(hidden)
        return {**c, "hidden": hidden[None]}


class TileVisionBlock(CarrierLayer):
    def __init__(self, block: nn.Module, inputs, outputs, takes_mask: bool):
        super().__init__(inputs, outputs)
        self.block, self.takes_mask = block, takes_mask

    def run(self, c):
        hidden = c["hidden"][0]
        hidden = first(self.block(hidden, None) if self.takes_mask else self.block(hidden))
        return {**c, "hidden": hidden[None]}


class TileProjector(CarrierLayer):
    """The vision features the model selects (the class token dropped under the "default" strategy), InternVL's
    pixel shuffle and final norm where it uses them, and the multimodal projector: (T, N, Dv) -> (T x tokens, D)."""

    def __init__(self, projector: nn.Module, inputs, outputs, drop_class: bool,
                 final_norm: nn.Module | None = None, shuffle: Callable | None = None, downsample: float = 1.0):
        super().__init__(inputs, outputs)
        self.projector, self.final_norm = projector, final_norm
        self.drop_class, self._shuffle, self.downsample = drop_class, shuffle, downsample

    def run(self, c):
        hidden = c["hidden"][0]
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        if self.drop_class:
            hidden = hidden[:, 1:, :]
        if self._shuffle is not None:
            tiles, channels = hidden.shape[0], hidden.shape[1]
            side = int(channels ** 0.5)
            hidden = self._shuffle(hidden.reshape(tiles, side, side, -1), scale_factor=self.downsample)
            hidden = hidden.reshape(tiles, -1, hidden.shape[-1])
        features = self.projector(hidden)
        return {**c, "features": features.reshape(1, -1, features.shape[-1])}


# --- the language model ---------------------------------------------------------------------------------------

class TextEmbed(CarrierLayer):
    """Token embeddings, each vision placeholder replaced by its feature (in the order the model scatters them:
    images, then videos); starts the text carrier."""

    def __init__(self, embed_tokens: nn.Module, inputs, outputs):
        super().__init__(inputs, outputs)
        self.embed_tokens = embed_tokens

    def run(self, c):
        hidden = self.embed_tokens(c["input_ids"])
        real, where = vision_places(c)
        hidden = hidden.index_put((torch.zeros_like(where), where), c["features"][0][real].to(hidden.dtype))
        return {**c, "hidden": hidden}


class DecoderLayer(CarrierLayer):
    """One decoder layer with its rotary embedding computed from the carried positions (M-RoPE: the 3 rows after
    the text row), attention per packed sample; Qwen3-VL's first layers add their DeepStack features after it."""

    def __init__(self, block: nn.Module, rotary: nn.Module, inputs, outputs, mrope: bool, takes_deepstack: bool):
        super().__init__(inputs, outputs)
        self.block, self.rotary = block, rotary
        self.mrope, self.takes_deepstack = mrope, takes_deepstack

    def run(self, c):
        hidden, positions = c["hidden"], c["positions"]
        text_positions = positions[:, 0]
        rope_positions = positions[0, 1:, None, :] if self.mrope else text_positions
        position_embeddings = self.rotary(hidden, rope_positions)
        kwargs = varlen_kwargs(c["bounds"][0])
        tree = continued_segments(c["bounds"][0], text_positions[0]) if self._reads_segments() else None
        if tree is not None:  # a group's responses or a tree's turns, each continuing its prefix (shared_prefix)
            kwargs["segment_parents"], kwargs["segment_starts"] = tree
        hidden = first(self.block(hidden, attention_mask=None, position_ids=text_positions,
                                  position_embeddings=position_embeddings, **kwargs))
        out = {**c, "hidden": hidden}
        if self.takes_deepstack:
            stack = c["deepstack"]
            real, where = vision_places(c)
            added = hidden[0, where] + stack[0, 0][real].to(hidden.dtype)
            out["hidden"] = hidden.index_put((torch.zeros_like(where), where), added)
            out["deepstack"] = stack[:, 1:]
        return out


    def _reads_segments(self) -> bool:
        """Its attention is Packfeed's varlen kernel, which reads a shared prefix's segments (a context-parallel
        runner's attention reads a share's rows instead, whose positions start mid-sample)."""
        config = getattr(getattr(self.block, "self_attn", None), "config", None)
        return getattr(config, "_attn_implementation", None) == VARLEN_ATTENTION


class Head(CarrierLayer):
    """Final norm, vocabulary projection and the summed next-token loss, as HF's loss computes it (labels shifted
    inside; the input builder set -100 at every sample's first token and on padding)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, inputs):
        super().__init__(inputs, ("loss",))
        self.norm, self.lm_head = norm, lm_head

    def run(self, c):
        logits = self.lm_head(self.norm(c["hidden"])).float()
        targets = F.pad(c["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device),
                               ignore_index=IGNORE_INDEX, reduction="sum")
        return {"loss": loss.reshape(1)}
