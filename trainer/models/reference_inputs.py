"""The reference model's inputs: a step's packs padded into its fixed-shape microbatches (see
`packfeed.trainer.batch`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import torch

from packfeed.client.model.shared_prefix import shared
from packfeed.trainer.batch import Microbatches, RoutedImages, StepShape, round_up
from packfeed.trainer.models.reference import IGNORE_INDEX, VLMConfig


def consumed_tiles(pack, config: VLMConfig) -> torch.Tensor:
    """Tiles of each image the pack consumes, from its placeholder spans (its pixels may be other ranks')."""
    spans = pack.image_token_spans.view(-1, 2).long()
    if bool((spans[:, 1] % config.tokens_per_tile).any()):
        raise ValueError(f"pack {pack.sample_keys}: image placeholder spans {spans[:, 1].tolist()} are not whole "
                         f"tiles of {config.tokens_per_tile} tokens; set the model's tokens_per_tile to the image "
                         "policy's")
    return spans[:, 1] // config.tokens_per_tile


def step_shape(packs, token_multiple: int = 64, epoch: int = 0, step: int = 0,
               last_in_epoch: bool = False, config: VLMConfig | None = None) -> StepShape:
    tokens = max([int(p.input_ids.numel()) for p in packs] + [1])
    if config is not None and packs and packs[0].routed:
        tiles = max([int(consumed_tiles(p, config).sum()) for p in packs] + [1])
    else:
        tiles = max([int(p.tile_shapes.shape[0]) for p in packs] + [1])
    samples = max([int(p.cu_seqlens.numel()) - 1 for p in packs] + [1])
    return StepShape(round_up(tokens, token_multiple), tiles, samples, int(packs[0].step_loss_tokens),
                     epoch, step, last_in_epoch)


def vision_positions_of(pack, config: VLMConfig) -> torch.Tensor:
    """For every vision token of every tile (in tile order), its position in input_ids."""
    spans = pack.image_token_spans.view(-1, 2).long()
    tiles_per_image = consumed_tiles(pack, config) if pack.routed else \
        torch.bincount(pack.tile_image.long(), minlength=spans.shape[0])
    if spans.shape[0] and not torch.equal(spans[:, 1], tiles_per_image * config.tokens_per_tile):
        raise ValueError(f"pack {pack.sample_keys}: image placeholder spans {spans[:, 1].tolist()} do not hold "
                         f"{config.tokens_per_tile} tokens per tile for tiles {tiles_per_image.tolist()}; set the "
                         f"model's tokens_per_tile to the image policy's")
    if spans.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(int(s), int(s) + int(n)) for s, n in spans.tolist()])


def pack_tiles(pack, config: VLMConfig) -> torch.Tensor:
    shapes = pack.tile_shapes.view(-1, 3)
    expected = torch.tensor([3, config.tile_size, config.tile_size], dtype=shapes.dtype)
    if shapes.shape[0] and not bool((shapes == expected).all()):
        raise ValueError(f"pack {pack.sample_keys}: tiles of shape {shapes.unique(dim=0).tolist()}, the model takes "
                         f"3x{config.tile_size}x{config.tile_size}; the reference trainer needs a tiling image "
                         f"policy (internvl or fixed) with that tile size")
    return pack.pixels.view(-1, 3, config.tile_size, config.tile_size)


def pad_pack(pack, shape: StepShape, config: VLMConfig) -> tuple[torch.Tensor, ...]:
    length, n_tiles = int(pack.input_ids.numel()), int(pack.tile_shapes.view(-1, 3).shape[0])
    if length and int(pack.input_ids.max()) >= config.vocab_size:
        raise ValueError(f"pack {pack.sample_keys}: token id {int(pack.input_ids.max())} >= the model's vocab_size "
                         f"{config.vocab_size}; size the model for the dataset's tokenizer")
    if pack.routed:  # the features come from the all-to-all: no pixels of its own enter the LLM
        pixels = torch.zeros(shape.tiles, 0, dtype=torch.uint8)
    else:
        pixels = torch.zeros(shape.tiles, 3, config.tile_size, config.tile_size, dtype=torch.uint8)
        pixels[:n_tiles] = pack_tiles(pack, config)
    input_ids = torch.zeros(shape.tokens, dtype=torch.int64)
    input_ids[:length] = pack.input_ids
    position_ids = torch.zeros(shape.tokens, dtype=torch.int64)
    position_ids[:length] = pack.position_ids
    labels = torch.full((shape.tokens,), IGNORE_INDEX, dtype=torch.int64)
    labels[:length] = pack.labels
    bounds = pack.cu_seqlens.long()
    cu_seqlens = torch.full((shape.samples + 1,), int(bounds[-1]) if bounds.numel() else 0, dtype=torch.int64)
    cu_seqlens[:bounds.numel()] = bounds
    vision_positions = torch.full((shape.tiles * config.tokens_per_tile,), -1, dtype=torch.int64)
    positions = vision_positions_of(pack, config)
    vision_positions[:positions.numel()] = positions
    return pixels, input_ids, position_ids, cu_seqlens, vision_positions, labels


def microbatches_of(step, config: VLMConfig, token_multiple: int = 64) -> Microbatches:
    """`step` is a `packfeed.client.Step` (or anything with `.packs`, `.epoch`, `.step`). Packs whose samples share
    a prefix are laid out with it once (`packfeed.client.model.shared_prefix.shared`): the model reads the segments
    continuing it from their positions."""
    packs = [with_repeated_targets(pack, shared(pack), config.vocab_size) for pack in step.packs]
    shape = step_shape(packs, token_multiple, step.epoch, step.step, step.last_in_epoch, config)
    padded = [pad_pack(pack, shape, config) for pack in packs]
    args = tuple(torch.cat(parts) for parts in zip(*padded))
    routed = [routed_images(pack, config) for pack in step.packs] if step.packs and step.packs[0].routed \
        else None
    return Microbatches(shape, args, sum(int(p.input_ids.numel()) for p in packs),
                        sum(int(p.tile_shapes.view(-1, 3).shape[0]) for p in packs),
                        dict(Counter(step.sample_sources)), routed)


def with_repeated_targets(wire, laid, vocab_size: int):
    """`laid` (a pack's shared layout) with each label that is a trained target of several samples (a tree's
    shared turn: each trajectory alone would learn it) as label + vocab_size x (repeats - 1), which the head
    weighs back (`LMHead.loss`), and a row trained by some sample but not the one whose copy it holds trained:
    the summed loss of each sample alone. A layout whose shared tokens are not trained (a group's prompt) comes
    back as it is."""
    if "placement" not in laid.tensors:
        return laid
    labels = wire.labels.long()
    trained = torch.nonzero(labels != IGNORE_INDEX).flatten()
    trained = trained[~torch.isin(trained, wire.cu_seqlens[:-1].long())]  # a sample's first token: no predictor
    rows = laid.placement[trained - 1] + 1  # the row whose label each trained token's prediction targets
    repeats = torch.bincount(rows, minlength=int(laid.input_ids.numel()))
    # each row's label: the token it is, where some sample trains it (label + vocab_size x (repeats - 1)), else
    # none: a trajectory's mask, not the row's copy of one of them, says what is trained
    wanted = torch.where(repeats > 0, laid.input_ids.long() + vocab_size * (repeats - 1).clamp(min=0), IGNORE_INDEX)
    trained_rows = repeats > 0
    if not bool((repeats > 1).any()) and torch.equal(laid.labels.long()[trained_rows], wanted[trained_rows]) \
            and not bool(((laid.labels.long() != IGNORE_INDEX) & ~trained_rows
                          & ~torch.isin(torch.arange(len(repeats)), laid.cu_seqlens[:-1].long())).any()):
        return laid
    return replace(laid, tensors={**laid.tensors, "labels": wanted})


def routed_images(pack, config: VLMConfig) -> RoutedImages:
    """What the pack's rank encodes (its pixels, `encode_target`) and where its own images come from."""
    targets = pack.encode_target.view(-1, 3).tolist()
    units = torch.bincount(pack.tile_image.long(), minlength=len(targets)).tolist()
    consumed = pack.image_encoder.view(-1, 3).tolist()
    samples = pack.image_sample.tolist()
    return RoutedImages(pack_tiles(pack, config), [(c, p, k, u) for (c, p, k), u in zip(targets, units)],
                        [(e, p, k, u, s) for (e, p, k), u, s in
                         zip(consumed, consumed_tiles(pack, config).tolist(), samples)])
