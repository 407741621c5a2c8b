"""Packs as torch tensors: `PackTensors` (one pack) and `Step` (a rank's M packs of one step), built over the
received message bytes without a copy (`pack_of`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from packfeed.client.stream.wire import array_of, split_pack

IGNORE_INDEX = -100  # labels of tokens outside the loss


@dataclass
class PackTensors:
    """One pack. Tensors (all int32 except `pixels`, uint8): input_ids, labels, position_ids (L); cu_seqlens
    (samples + 1); pixels (every tile's C*H*W bytes); tile_shapes (tiles x 3); tile_image (tiles);
    image_sample (images); image_token_spans (images x 2: start in input_ids, length). A routed pack (plan
    strategy isf+phases; `routed`) adds image_encoder (images x 3: the rank encoding each image it consumes),
    and its pixels are the images its rank encodes, one row each in encode_target (x 3: consuming rank,
    planned position, image number) with encode_tokens; docs/wire.md "Packs on the wire". With encoder ranks
    (plan encoder_ranks > 0) an LLM rank's pack is routed with no pixels, and an encoder rank's (`encoder`)
    has only the images it encodes (docs/wire.md "Encoder ranks")."""

    epoch: int
    step: int
    rank: int
    microbatch: int
    empty: bool
    sample_keys: list[str]
    loss_tokens: int
    step_loss_tokens: int
    skipped: list[tuple[str, str]]
    tensors: dict[str, torch.Tensor]
    nbytes: int = 0
    microbatches: int = 1
    last_in_epoch: bool = False
    sample_sources: list[str] = field(default_factory=list)  # each sample's dataset (a mixture's name for it)
    encoder: bool = False  # an encoder rank's pack (plan encoder_ranks > 0): `rank` is the encoder rank
    sample_groups: list[str] = field(default_factory=list)  # a live job's: the prompt each sample answers

    def __getattr__(self, name: str) -> torch.Tensor:
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(name)

    @property
    def token_tensors(self) -> dict[str, torch.Tensor]:
        """A live job's per-token tensors by name (float32, beside input_ids: advantages, old log-probabilities,
        ...), as its producers put them."""
        return {name[len("token."):]: tensor for name, tensor in self.tensors.items() if name.startswith("token.")}

    @property
    def sample_values(self) -> dict[str, torch.Tensor]:
        """A live job's per-sample values by name (float64, one per sample: a reward, ...), as put. Each token's
        policy version is `token_policy_version` (int64, beside input_ids), each sample's `policy_version`."""
        return {name[len("value."):]: tensor for name, tensor in self.tensors.items() if name.startswith("value.")}

    @property
    def routed(self) -> bool:
        """Its images are encoded where the plan routes them (isf+phases), not all by this rank."""
        return "image_encoder" in self.tensors

    def tiles(self) -> list[torch.Tensor]:
        """Every tile as a (C, H, W) uint8 view of `pixels`."""
        out, offset = [], 0
        for c, h, w in self.tile_shapes.tolist():
            out.append(self.pixels[offset:offset + c * h * w].view(c, h, w))
            offset += c * h * w
        return out


@dataclass
class Step:
    epoch: int
    step: int
    rank: int
    packs: list[PackTensors]
    last_in_epoch: bool = False
    client_skipped: list[tuple[str, str]] = field(default_factory=list)  # samples left out here (encoded images)

    @property
    def sample_keys(self) -> list[str]:
        return [key for pack in self.packs for key in pack.sample_keys]

    @property
    def sample_sources(self) -> list[str]:
        return [source for pack in self.packs for source in pack.sample_sources]

    @property
    def step_loss_tokens(self) -> int:
        return self.packs[0].step_loss_tokens if self.packs else 0

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.packs)


def tensor_of(array: np.ndarray, pin_memory: bool = False) -> torch.Tensor:
    """A torch view of a read-only numpy view of the message bytes (or one copy into pinned memory)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(array)
    return tensor.pin_memory() if pin_memory else tensor


def pack_of(message: bytes, pin_memory: bool = False) -> PackTensors:
    """A serialized `packfeed.v1.Pack` as torch tensors over the message's own bytes."""
    fields, wires = split_pack(message)
    tensors = {name: tensor_of(array_of(message, wire), pin_memory) for name, wire in wires.items()}
    return PackTensors(fields.epoch, fields.step, fields.rank, fields.microbatch, fields.empty,
                       list(fields.sample_keys), fields.loss_tokens, fields.step_loss_tokens,
                       [(s.key, s.reason) for s in fields.skipped], tensors,
                       sum(wire.nbytes for wire in wires.values()), fields.microbatches, fields.last_in_epoch,
                       list(fields.sample_sources), fields.encoder, list(fields.sample_groups))
