"""A small but real vision-language model, written as a flat list of layers so a pipeline can cut it anywhere.

    pixels ─ VisionEmbed ─ ViTBlock × n ─ VisionProjector ─┐
                                                            ├─ TextEmbed (vision features replace the
    input_ids ──────────────────────────────────────────────┘   image placeholders) ─ LLMBlock × n ─ LMHead → loss

Every layer maps one tuple of tensors (its "carrier") to the next, so a pipeline stage is just a run of
consecutive layers and the tensors crossing a stage boundary are exactly what the next layer needs:

    vision carrier: (vis (T, N, Dv) float, input_ids, position_ids, cu_seqlens, vision_positions, labels)
    text carrier:   (hidden (L, D) float, position_ids, cu_seqlens, labels)
    head output:    (loss_sum (1,),)   summed next-token cross-entropy; the caller divides by the step's tokens

Shapes are fixed per microbatch (see `packfeed.trainer.batch`): padded tiles have vision_positions -1,
padded tokens sit after cu_seqlens' last real boundary with labels -100.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from packfeed.client.model.attention import flash_varlen_attention, segment_attention
from packfeed.client.model.shared_prefix import continued_segments
from packfeed.trainer.models.flavors import REFERENCE_FLAVORS, check_flavor, hf_sizes
from packfeed.v1 import packfeed_pb2 as pb

IGNORE_INDEX = -100
IMAGE_MEAN = (0.485, 0.456, 0.406)  # ImageNet statistics, as InternVL normalises its tiles
IMAGE_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class VLMConfig:
    """The trainer's `model` section: which model (`hf`: the reference VLM when empty, else a `transformers`
    family), its named sizes (`flavor`: packfeed.trainer.models.flavors) and sizes given one by one, which
    override the flavor's. The reference model's sizes are the fields below (None: the flavor's);
    `tile_size`/`tokens_per_tile` and the vocabulary are the dataset's (the trainer takes them from the
    conventions its server reports; InternVL: 448 px, 256 tokens; LLaVA fixed: 336 px, 576 tokens)."""

    vocab_size: int = 1024
    tile_size: int = 448
    tokens_per_tile: int = 256
    patch_size: int = 14
    vit_dim: int | None = None
    vit_layers: int | None = None
    vit_heads: int | None = None
    llm_dim: int | None = None
    llm_layers: int | None = None
    llm_heads: int | None = None
    mlp_ratio: float | None = None
    # the LLM's SwiGLU width (2/3 of llm_dim x mlp_ratio, LLaMA's) rounded up to a multiple of this: tensor cores
    # need a multiple of 8 in bf16 (2b: 256, 5,632 instead of 5,461)
    ffn_multiple: int | None = None
    rope_theta: float = 10000.0
    seed: int = 0
    # A Hugging Face VLM instead of the reference model (packfeed.trainer.models.hf: pipelined at pp > 1, run
    # whole and FSDP2-sharded at pp = 1): its family, sizes over the flavor's ({text: {...}, vision: {...},
    # top-level fields}) and attention.
    hf: Literal["", "internvl", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"] = ""
    flavor: str = "tiny"
    hf_config: dict = field(default_factory=dict)
    # auto: flash_attention_2 on CUDA when installed, else Packfeed's varlen kernel (packfeed.client.model.hf)
    hf_attention: Literal["auto", "varlen", "sdpa", "flash_attention_2"] = "auto"

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for name in ("hf", "hf_attention"):
            choices = typing.get_args(hints[name])
            if getattr(self, name) not in choices:
                raise ValueError(f"model.{name} = {getattr(self, name)!r}: choose one of "
                                 f"{', '.join(c for c in choices if c)}")
        check_flavor(self.hf, self.flavor)
        for name, value in REFERENCE_FLAVORS["tiny" if self.hf else self.flavor].items():
            if getattr(self, name) is None:  # (a frozen dataclass: completed once, here)
                object.__setattr__(self, name, value)

    @property
    def hf_sizes(self) -> dict:
        """A `transformers` model's sizes: its flavor's, then `hf_config`'s."""
        return hf_sizes(self.hf, self.flavor, dict(self.hf_config))

    @property
    def llm_ffn(self) -> int:
        """The LLM's SwiGLU width."""
        width = int(self.llm_dim * self.mlp_ratio * 2 / 3)
        return -(-width // self.ffn_multiple) * self.ffn_multiple

    @property
    def grid(self) -> int:
        if self.tile_size % self.patch_size:
            raise ValueError(f"tile_size {self.tile_size} is not a multiple of patch_size {self.patch_size}")
        return self.tile_size // self.patch_size

    @property
    def shuffle(self) -> int:
        """Pixel-shuffle factor: patch grid side / vision-token grid side (InternVL: 32 / 16 = 2)."""
        side = math.isqrt(self.tokens_per_tile)
        if side * side != self.tokens_per_tile or self.grid % side:
            raise ValueError(f"{self.tokens_per_tile} tokens per tile cannot come from a {self.grid}x{self.grid} "
                             f"patch grid by pixel shuffle: pick a patch_size whose grid is a multiple of {side}")
        return self.grid // side

    @property
    def n_layers(self) -> int:
        return len(layer_kinds(self))


def layer_kinds(config: VLMConfig) -> list[str]:
    """The model's layers in order; partitions and recompute plans index into this list."""
    return (["vision_embed"] + ["vit"] * config.vit_layers + ["projector", "text_embed"]
            + ["llm"] * config.llm_layers + ["head"])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False), \
            nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x (L, heads, d) at integer positions (L,), rotating pairs of half-dimensions."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Causal attention over a pack (q, k, v: (L, heads, d)) where token i only sees earlier tokens of its own
    sample, with no L x L mask: one flash-attention varlen call on CUDA in bf16 / fp16, else one SDPA call per
    sample. Tokens after the last boundary (padding) attend among themselves and are never read."""
    bounds = cu_seqlens.tolist()
    if bounds[-1] < q.shape[0]:
        bounds.append(q.shape[0])
    flash = flash_varlen_attention(q, k, v, torch.tensor(bounds), torch.tensor(bounds), causal=True)
    if flash is not None:
        return flash
    out = torch.empty_like(q)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1),
                is_causal=True).transpose(0, 1)
    return out


class VisionEmbed(nn.Module):
    """uint8 tiles (T, 3, S, S) -> normalised -> patch embeddings (T, N, Dv) + learned positions."""

    def __init__(self, c: VLMConfig):
        super().__init__()
        self.patch = nn.Conv2d(3, c.vit_dim, kernel_size=c.patch_size, stride=c.patch_size)
        self.position = nn.Parameter(torch.randn(1, c.grid * c.grid, c.vit_dim) * 0.02)
        self.register_buffer("mean", torch.tensor(IMAGE_MEAN).view(1, 3, 1, 1) * 255, persistent=False)
        self.register_buffer("std", torch.tensor(IMAGE_STD).view(1, 3, 1, 1) * 255, persistent=False)

    def forward(self, pixels, input_ids, position_ids, cu_seqlens, vision_positions, labels):
        x = (pixels.to(self.mean.dtype) - self.mean) / self.std
        vis = self.patch(x).flatten(2).transpose(1, 2) + self.position
        return vis, input_ids, position_ids, cu_seqlens, vision_positions, labels


class ViTBlock(nn.Module):
    """Pre-norm transformer block; every tile attends within itself (bidirectional)."""

    def __init__(self, c: VLMConfig):
        super().__init__()
        self.heads = c.vit_heads
        self.norm1, self.norm2 = nn.LayerNorm(c.vit_dim), nn.LayerNorm(c.vit_dim)
        self.qkv, self.proj = nn.Linear(c.vit_dim, 3 * c.vit_dim), nn.Linear(c.vit_dim, c.vit_dim)
        hidden = int(c.vit_dim * c.mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(c.vit_dim, hidden), nn.GELU(), nn.Linear(hidden, c.vit_dim))

    def forward(self, vis, *rest):
        t, n, d = vis.shape
        q, k, v = self.qkv(self.norm1(vis)).view(t, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(t, n, d)
        vis = vis + self.proj(attended)
        vis = vis + self.mlp(self.norm2(vis))
        return (vis, *rest)


class VisionProjector(nn.Module):
    """InternVL's pixel shuffle (s x s neighbouring patches -> one token with s² x the channels) + MLP to the
    LLM width: (T, N, Dv) -> (T, tokens_per_tile, D). Fewer, wider tokens: the cheapest place to cut."""

    def __init__(self, c: VLMConfig):
        super().__init__()
        self.grid, self.shuffle = c.grid, c.shuffle
        wide = c.vit_dim * self.shuffle ** 2
        self.mlp = nn.Sequential(nn.LayerNorm(wide), nn.Linear(wide, c.llm_dim), nn.GELU(),
                                 nn.Linear(c.llm_dim, c.llm_dim))

    def forward(self, vis, *rest):
        t, _, d = vis.shape
        g, s = self.grid, self.shuffle
        x = vis.view(t, g // s, s, g // s, s, d).permute(0, 1, 3, 2, 4, 5).reshape(t, (g // s) ** 2, s * s * d)
        return (self.mlp(x), *rest)


class TextEmbed(nn.Module):
    """Token embeddings with each image placeholder replaced by its vision token; starts the text carrier."""

    def __init__(self, c: VLMConfig):
        super().__init__()
        self.vocab_size = c.vocab_size
        self.embed = nn.Embedding(c.vocab_size, c.llm_dim)

    def forward(self, vis, input_ids, position_ids, cu_seqlens, vision_positions, labels):
        hidden = self.embed(input_ids.long())
        features = vis.reshape(-1, vis.shape[-1])
        real = vision_positions >= 0
        hidden = hidden.index_put((vision_positions[real].long(),), features[real].to(hidden.dtype))
        return hidden, position_ids, cu_seqlens, labels


class LLMBlock(nn.Module):
    """Pre-norm decoder block: RMSNorm, RoPE, causal attention within each packed sample, SwiGLU. `attention`
    is the attention function (q, k, v, cu_seqlens) -> out: context parallelism replaces it with one over the
    GPUs a pack is split among (`packfeed.trainer.parallel.context_parallel`). A pack laid out with shared
    prefixes (`packfeed.client.model.shared_prefix.shared`) has segments that continue a prefix, read from their
    positions: each attends to its prefix and itself."""

    def __init__(self, c: VLMConfig):
        super().__init__()
        self.attention = packed_causal_attention
        self.heads, self.theta = c.llm_heads, c.rope_theta
        self.norm1, self.norm2 = RMSNorm(c.llm_dim), RMSNorm(c.llm_dim)
        self.qkv = nn.Linear(c.llm_dim, 3 * c.llm_dim, bias=False)
        self.proj = nn.Linear(c.llm_dim, c.llm_dim, bias=False)
        self.mlp = SwiGLU(c.llm_dim, c.llm_ffn)

    def forward(self, hidden, position_ids, cu_seqlens, labels):
        length, d = hidden.shape
        q, k, v = self.qkv(self.norm1(hidden)).view(length, 3, self.heads, d // self.heads).unbind(1)
        q, k = rope(q, position_ids, self.theta), rope(k, position_ids, self.theta)
        tree = continued_segments(cu_seqlens, position_ids) if self.attention is packed_causal_attention else None
        attended = self.attention(q, k, v, cu_seqlens) if tree is None else \
            segment_attention(q, k, v, cu_seqlens.tolist(), tree[0], starts=tree[1])  # a prefix's turns see it
        hidden = hidden + self.proj(attended.reshape(length, d))
        hidden = hidden + self.mlp(self.norm2(hidden))
        return hidden, position_ids, cu_seqlens, labels


class LMHead(nn.Module):
    """Final norm, vocabulary projection and the summed next-token loss (never across a sample boundary)."""

    def __init__(self, c: VLMConfig):
        super().__init__()
        self.norm = RMSNorm(c.llm_dim)
        self.out = nn.Linear(c.llm_dim, c.vocab_size, bias=False)

    def forward(self, hidden, position_ids, cu_seqlens, labels):
        return (self.loss(hidden, next_token_targets(labels, cu_seqlens)),)

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy of `hidden`'s predictions of `targets` (IGNORE_INDEX: none), shape (1,). A
        target of vocab_size x r + token is a tree's shared token trained in r + 1 samples: counted r + 1 times
        (`reference_inputs.with_repeated_targets`)."""
        logits = self.out(self.norm(hidden)).float()
        vocab = self.out.out_features
        if not bool((targets >= vocab).any()):
            return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum").reshape(1)
        kept = targets >= 0
        repeats = torch.where(kept, targets // vocab + 1, 0).to(logits.dtype)
        losses = F.cross_entropy(logits, torch.where(kept, targets % vocab, targets), ignore_index=IGNORE_INDEX,
                                 reduction="none")
        return (losses * repeats).sum().reshape(1)


def next_token_targets(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Position t learns labels[t + 1] of the same sample; each sample's last position learns nothing."""
    targets = torch.roll(labels.long(), -1)
    ends = cu_seqlens[1:].long() - 1
    targets[ends[ends >= 0]] = IGNORE_INDEX
    targets[int(cu_seqlens[-1]):] = IGNORE_INDEX
    return targets


LAYER_TYPES = {"vision_embed": VisionEmbed, "vit": ViTBlock, "projector": VisionProjector,
               "text_embed": TextEmbed, "llm": LLMBlock, "head": LMHead}


def build_layers(config: VLMConfig) -> nn.ModuleList:
    """All layers, initialised from `config.seed` — every process building the model gets the same weights,
    whichever layers it later keeps."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(config.seed)
    try:
        return nn.ModuleList([LAYER_TYPES[kind](config) for kind in layer_kinds(config)])
    finally:
        torch.random.set_rng_state(generator_state)


def example_carrier(config: VLMConfig, before_layer: int, tokens: int, tiles: int, samples: int,
                    device: torch.device | str = "meta", dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Empty tensors shaped like the carrier entering layer `before_layer` (= n_layers: the head's output) for
    one microbatch of that size. Pipeline stages are built from these instead of running the model on
    placeholder data, which data-dependent layers (index ops, per-sample attention) cannot take."""
    kinds = layer_kinds(config)
    def empty(*size, kind=torch.int64):
        return torch.empty(*size, dtype=kind, device=device)
    meta = (empty(tokens), empty(tokens), empty(samples + 1), empty(tiles * config.tokens_per_tile), empty(tokens))
    text = (empty(tokens, config.llm_dim, kind=dtype), empty(tokens), empty(samples + 1), empty(tokens))
    if before_layer >= len(kinds):
        return (empty(1, kind=torch.float32),)
    kind = kinds[before_layer]
    if kind == "vision_embed":
        return (empty(tiles, 3, config.tile_size, config.tile_size, kind=torch.uint8), *meta)
    if kind in ("vit", "projector"):
        return (empty(tiles, config.grid ** 2, config.vit_dim, kind=dtype), *meta)
    if kind == "text_embed":
        return (empty(tiles, config.tokens_per_tile, config.llm_dim, kind=dtype), *meta)
    return text


def run_layers(layers, carrier: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    for layer in layers:
        carrier = layer(*carrier)
    return carrier


def sized_model(model: VLMConfig, conventions: pb.ModelConventions) -> VLMConfig:
    """`model` with the tile size, tokens per tile and vocabulary of the job's dataset (as its server reports
    them): the packs decide these, not the user. A new config; the one given is not changed."""
    policy = conventions.image_policy
    if not policy.tile_size or not policy.tokens_per_tile:
        raise ValueError(f"the dataset's image policy {policy.name!r} makes images of varying size; the reference "
                         "trainer needs square tiles (index with --image-policy internvl or fixed)")
    vocab = max(model.vocab_size, -(-conventions.vocab_size // 64) * 64)
    return replace(model, tile_size=policy.tile_size, tokens_per_tile=policy.tokens_per_tile, vocab_size=vocab)
