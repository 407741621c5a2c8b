"""A live sample as a producer puts it (`packfeed.v1.LiveSample`), checked against its job's dataset before
anything of it is kept: its token ids within the vocabulary, its per-token tensors as long as its tokens, its
images (by reference to an indexed prompt, or as files) matching their placeholders, and its size within the
job's caps. A refusal names the field and the reason; the producer's other samples go on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import xxhash

from packfeed.media.image_policy import ImagePolicy
from packfeed.media.prompts import shared_prompt
from packfeed.media.samples import SampleError, image_size
from packfeed.server.index.table import member_checksum
from packfeed.server.live.refused import Refused  # noqa: F401  (re-exported: the put's callers catch it here)
from packfeed.server.live.trajectories import check_placeholders, checked_turns, inherit, turn_digests
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1.options import MAX_NAME

MAX_SAMPLE_TOKENS = 1 << 20  # a live sample longer than this is refused whatever the caps
MAX_TENSORS = 16  # named per-token tensors a sample may carry
MAX_IMAGES = 256
MAX_VALUES = 16  # named per-sample values (a reward, ...)
SPOOLED_NAMES = ("tokens", "loss_mask", "token_versions")  # a sample's own arrays in the spool, beside its tensors


@dataclass(frozen=True)
class SampleRules:
    """What a job's samples must satisfy: its dataset's conventions and caps."""

    vocab_size: int
    image_context_id: int
    policy: ImagePolicy
    # an indexed prompt's sample id and image sizes (None: not in the index, or not referable)
    prompt_images: Callable[[str], tuple[int, list[tuple[int, int]]] | None]
    max_tokens: int = MAX_SAMPLE_TOKENS  # the job's token cap, when it has one
    max_vision: int = 0  # the job's vision cap (0: none)
    # what decoding one image may take when it is served (the server's working limit; 0: any), and what its
    # pixel mode holds per pixel: an image over it would be skipped when served, so it is refused at its put
    decode_budget: int = 0
    decode_bytes_per_pixel: int = 0
    # why a sample sharing its group's prompt cannot be planned in this job ("": it can), as an index with groups
    # is refused when planned (`PlanConfig.prefix_sharing_refusal`)
    prefix_refusal: str = ""


@dataclass
class LiveSample:
    """A checked sample: its arrays, and what the planner counts of it."""

    id: str
    tokens: np.ndarray  # int32 (L,)
    loss_mask: np.ndarray  # uint8 (L,)
    tensors: dict[str, np.ndarray]  # float32 (L,) each
    group: str
    policy_version: int
    prompt: str  # the indexed sample whose images it uses ("": none, or its own `images`)
    images: list[bytes]
    sizes: list[tuple[int, int]]  # (width, height) of each image
    prompt_id: int = -1  # `prompt`'s number in the job's dataset (over a mixture's indexes in order)
    vision: int = 0  # vision units
    pixel_bytes: int = 0  # of its tiles, uint8
    vit_patches: float = 0.0
    vit_attn_sq: float = 0.0
    loss_tokens: int = 0
    # its prefix: the tokens before its first loss token, and what it is (those tokens, its images): samples of one
    # group with the same prefix key share it ("" : it shares none: no group, or an image after the prefix)
    prefix: int = 0
    prefix_key: str = ""
    members: dict[str, bytes] = field(default_factory=dict)  # filled by the spool
    digest: str = ""  # of everything the producer put ("" : not computed): a retry matches it, another sample not
    values: dict[str, float] = field(default_factory=dict)  # per-sample values by name (a reward, ...)
    # a partial rollout: put unfinished (its prefix so far), its part's number, and each token's policy version
    # (None: policy_version for every token)
    unfinished: bool = False
    part: int = 0
    token_versions: np.ndarray | None = None
    covers: str = ""  # an unfinished part's `prefix_digest` over all its tokens: what its continuation starts with
    producer: str = ""  # the producer that put it (its id; "": it named none)
    # a trajectory (`packfeed.server.live.trajectories`): its turns (role, tokens, images), the digest of its tokens
    # up to each turn's end, and of a fork its parent's id, the turns and tokens it shares with it and the spool
    # places of the images it inherits there (set when spooled); `sizes` are then its whole trajectory's images
    turns: tuple = ()
    turn_digests: tuple = ()
    parent: str = ""
    fork_turn: int = 0
    fork_tokens: int = 0
    inherited_images: int = 0
    inherited_vision: int = 0

    def content_digest(self) -> str:
        """What a put of the same id must match to be a retry: its arrays, tags, image files and (of a rollout put
        in parts, or with values) those too. A sample of none of them digests as it always did."""
        extra = [str(self.part).encode(), b"u" if self.unfinished else b"f",
                 *(part for name, value in sorted(self.values.items()) for part in (name.encode(), repr(value).encode())),
                 *(() if self.token_versions is None else (self.token_versions,))] \
            if self.part or self.unfinished or self.values or self.token_versions is not None else []
        if self.turns:  # a trajectory's turns and fork are what it is too
            extra += [repr(self.turns).encode(), self.parent.encode(), str(self.fork_turn).encode()]
        return _digest([self.tokens, self.loss_mask, self.group.encode(), str(self.policy_version).encode(),
                        self.prompt.encode(), *self._tensor_parts(len(self.tokens)), *self.images, *extra])

    def prefix_digest(self, n: int) -> str:
        """The digest of its first `n` tokens (their mask, tensors and versions) with its group, prompt and images:
        a continuation of an unfinished rollout must start with what was put of it (`covers`)."""
        return _digest([self.tokens[:n], self.loss_mask[:n], self.group.encode(), self.prompt.encode(),
                        *self._tensor_parts(n), self.versions()[:n], *self.images])

    def _tensor_parts(self, n: int) -> list:
        return [part for name, values in sorted(self.tensors.items()) for part in (name.encode(), values[:n])]

    def versions(self) -> np.ndarray:
        """Each token's policy version."""
        return self.token_versions if self.token_versions is not None else \
            np.full(len(self.tokens), self.policy_version, np.int64)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def check_id(value: str) -> str:
    if not value or len(value) > MAX_NAME or not value.isprintable():
        raise Refused("id", f"give every sample an id of 1 to {MAX_NAME} printable characters (retries reuse it)")
    return value


def checked_sample(message: pb.LiveSample, rules: SampleRules) -> LiveSample:
    """The sample, or Refused with the field and the reason."""
    sample_id = check_id(message.id)
    tokens = _array(message.tokens, "tokens", np.int32)
    if not 1 <= len(tokens) <= min(rules.max_tokens, MAX_SAMPLE_TOKENS):
        raise Refused("tokens", f"{len(tokens):,} tokens: a sample of this job holds 1 to "
                                f"{min(rules.max_tokens, MAX_SAMPLE_TOKENS):,} (its token cap under oversize skip, "
                                f"or {MAX_SAMPLE_TOKENS:,})")
    if tokens.min() < 0 or tokens.max() >= rules.vocab_size:
        bad = int(tokens[(tokens < 0) | (tokens >= rules.vocab_size)][0])
        raise Refused("tokens", f"token id {bad} is outside the vocabulary (0 to {rules.vocab_size - 1})")
    mask = _array(message.loss_mask, "loss_mask", np.uint8) if message.HasField("loss_mask") else \
        np.ones(len(tokens), np.uint8)
    if len(mask) != len(tokens) or mask.max(initial=0) > 1:
        raise Refused("loss_mask", f"give one 0 or 1 per token ({len(tokens)}), not {len(mask)} values up to "
                                   f"{int(mask.max(initial=0))}")
    if len(message.tensors) > MAX_TENSORS:
        raise Refused("tensors", f"{len(message.tensors)} tensors: at most {MAX_TENSORS}")
    tensors = {}
    for name, tensor in sorted(message.tensors.items()):
        _check_name(name, "tensors", "tensor")
        if name in SPOOLED_NAMES:
            raise Refused("tensors", f"tensor name {name!r} is the sample's own field: name it otherwise")
        values = _array(tensor, f"tensors[{name}]", np.float32)
        if len(values) != len(tokens):
            raise Refused(f"tensors[{name}]", f"{len(values)} values for {len(tokens)} tokens: one per token")
        if not np.isfinite(values).all():
            raise Refused(f"tensors[{name}]", "holds NaN or infinity")
        tensors[name] = values
    sample = LiveSample(sample_id, tokens, mask, tensors, message.group[:MAX_NAME], int(message.policy_version),
                        message.prompt, list(message.images), [], loss_tokens=int(mask.sum()),
                        values=_values(message), unfinished=message.unfinished, part=int(message.part))
    _check_versions(sample, message)
    if message.turns or message.parent or message.fork_turn:  # a trajectory (`trajectories`)
        sample.turns = checked_turns(message, sample)
        sample.parent, sample.fork_turn = message.parent[:MAX_NAME], int(message.fork_turn)
        sample.turn_digests = turn_digests(sample.tokens, sample.turns)
    if sample.parent:  # its images are costed once its parent is found (`finish_fork`): their sizes now
        if sample.prompt:
            raise Refused("prompt", "a fork carries its own turns' images as files (its earlier turns' are its "
                                    "parent's): give images, not a prompt")
        sample.sizes = [_image_size(data, k, rules) for k, data in enumerate(sample.images)]
    else:
        _check_images(sample, rules)
        _find_prefix(sample, rules.image_context_id)
    if sample.prefix_key and rules.prefix_refusal:
        raise Refused("group", f"the sample shares its group's prompt, and {rules.prefix_refusal} when the job "
                               "opens (or put it without a group)")
    sample.digest = sample.content_digest()
    if sample.unfinished:
        sample.covers = sample.prefix_digest(len(tokens))
    return sample


def _values(message: pb.LiveSample) -> dict[str, float]:
    if len(message.values) > MAX_VALUES:
        raise Refused("values", f"{len(message.values)} values: at most {MAX_VALUES}")
    for name, value in message.values.items():
        _check_name(name, "values", "value")
        if not np.isfinite(value):
            raise Refused(f"values[{name}]", "is NaN or infinite")
    return dict(sorted(message.values.items()))


def _check_name(name: str, field_name: str, what: str) -> None:
    """A tensor's or value's name: what packs carry it as (`token.NAME`, `value.NAME`)."""
    if not name or len(name) > 64 or not name.replace("_", "").isalnum():
        raise Refused(field_name, f"{what} name {name[:64]!r}: use 1-64 letters, digits and underscores")


def _check_versions(sample: LiveSample, message: pb.LiveSample) -> None:
    """Per-token policy versions (a rollout continued with newer weights): one per token, and the sample's
    policy_version the newest of them (0: set so)."""
    if not message.HasField("token_versions"):
        return
    versions = _array(message.token_versions, "token_versions", np.int64)
    if len(versions) != len(sample.tokens):
        raise Refused("token_versions", f"{len(versions)} versions for {len(sample.tokens)} tokens: one per token")
    newest = int(versions.max())
    if sample.policy_version not in (0, newest) or versions.min() < 0:
        raise Refused("policy_version", f"{sample.policy_version}: a sample's policy_version is the newest of its "
                                        f"token_versions ({newest}), which are >= 0")
    sample.token_versions, sample.policy_version = versions, newest


def _digest(parts: list) -> str:
    hasher = xxhash.xxh3_128()
    for part in parts:
        view = memoryview(part).cast("B")  # no copy of an array
        hasher.update(len(view).to_bytes(8, "little"))
        hasher.update(view)
    return hasher.hexdigest()


def _find_prefix(sample: LiveSample, context_id: int) -> None:
    """The prompt a group's samples share (`packfeed.media.prompts`): its images by reference (the prompt's key)
    or as files (their checksums)."""
    if not sample.group:
        return
    starts, lengths = placeholder_runs(sample.tokens, context_id)
    prompt = shared_prompt(sample.tokens, sample.loss_mask > 0, int((starts + lengths).max(initial=0)),
                           [member_checksum(data) for data in sample.images], sample.prompt.encode())
    if prompt is not None:
        sample.prefix, sample.prefix_key = prompt


def _array(tensor: pb.Tensor, what: str, dtype) -> np.ndarray:
    """A wire Tensor as a 1-D array of `dtype` (its declared dtype must be that one)."""
    dtype = np.dtype(dtype)
    if tensor.dtype and tensor.dtype != dtype.name:
        raise Refused(what, f"dtype {tensor.dtype[:32]!r}: send {dtype.name}")
    itemsize, data = dtype.itemsize, tensor.data  # (each read of a bytes field is a copy of it)
    if len(data) % itemsize or (tensor.shape and list(tensor.shape) != [len(data) // itemsize]):
        raise Refused(what, f"{len(data)} bytes, shape {list(tensor.shape)[:4]}: send a 1-D {dtype.name} array")
    return np.frombuffer(data, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)  # read-only, no copy


def finish_fork(sample: LiveSample, parent, rules: SampleRules) -> None:
    """A fork whose parent (a row of its job, or a sample earlier in its put) was found: its inherited turns and
    images checked and its whole trajectory's images costed (Refused as a put's checks refuse)."""
    inherited = inherit(sample, parent)
    sample.sizes = inherited + list(sample.sizes)
    _cost_images(sample, sample.sizes, rules)
    sample.inherited_vision = sum(rules.policy.cost(w, h, len(sample.sizes)).units for w, h in inherited)


def _check_images(sample: LiveSample, rules: SampleRules) -> None:
    """Its images' sizes and costs, and their placeholder runs in its tokens: one run of image_context_id per
    image, in order, each exactly as long as that image's placeholder tokens."""
    if sample.prompt and sample.images:
        raise Refused("prompt", "give its images by reference (prompt) or as files (images), not both")
    if sample.prompt:
        found = rules.prompt_images(sample.prompt)
        if found is None:
            raise Refused("prompt", f"no indexed sample {sample.prompt[:MAX_NAME]!r} in the job's dataset (or it "
                                    "holds videos, which live samples do not reference yet, or a mixture's datasets "
                                    "hold two samples of that key)")
        sample.prompt_id, sizes = found
    else:
        if len(sample.images) > MAX_IMAGES:
            raise Refused("images", f"{len(sample.images)} images: at most {MAX_IMAGES}")
        sizes = [_image_size(data, k, rules) for k, data in enumerate(sample.images)]
    _cost_images(sample, sizes, rules)


def _cost_images(sample: LiveSample, sizes: list[tuple[int, int]], rules: SampleRules) -> None:
    """The costs of its images (`sizes`, its whole trajectory's), checked against its placeholder runs (turn by
    turn for a trajectory)."""
    costs = [rules.policy.cost(width, height, len(sizes)) for width, height in sizes]
    starts, lengths = placeholder_runs(sample.tokens, rules.image_context_id)
    runs = lengths.tolist()
    expected = [cost.llm_tokens for cost in costs]
    if sample.turns:
        check_placeholders(sample.turns, starts, lengths, expected, rules.image_context_id)
    if runs != expected:
        raise Refused("tokens", f"its image placeholders (runs of token {rules.image_context_id}) are {runs}; its "
                                f"{len(sizes)} images need runs of {expected} under the dataset's image policy")
    sample.sizes = [(int(w), int(h)) for w, h in sizes]
    sample.vision = sum(cost.units for cost in costs)
    sample.vit_patches = float(sum(cost.vit_patches for cost in costs))
    sample.vit_attn_sq = float(sum(cost.vit_attn_sq for cost in costs))
    sample.pixel_bytes = sum(int(np.prod(shape)) for w, h in sizes
                             for shape in rules.policy.geometry(w, h, len(sizes)).tile_shapes())
    if rules.max_vision and sample.vision > rules.max_vision:
        raise Refused("images", f"{sample.vision} vision units: over the job's vision cap {rules.max_vision} "
                                "(oversize skip)")


def _image_size(data: bytes, k: int, rules: SampleRules) -> tuple[int, int]:
    """The image file's upright size, once it decoded whole: a truncated or corrupt file, one over the policy's
    pixel limit (a decompression bomb: refused from its header, before decoding) or over what the server may
    decode for one image is refused here, never accepted and skipped when served."""
    try:
        width, height = image_size(data, "header", rules.policy)
        need = width * height * rules.decode_bytes_per_pixel
        if rules.decode_budget and need > rules.decode_budget:
            raise Refused(f"images[{k}]", f"a {width}x{height} image needs ~{need >> 20:,} MiB to decode, more than "
                                          f"the server may take for one image ({rules.decode_budget >> 20:,} MiB): "
                                          "send it smaller, or raise the server's memory_budget_mb")
        return image_size(data, "full", rules.policy)
    except SampleError as error:
        raise Refused(f"images[{k}]", f"not a usable image file: {error}") from None


def placeholder_runs(tokens: np.ndarray, context_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of each run of `context_id` in `tokens`, in order: a sample's image placeholders, checked
    at its put and placed when it is served."""
    hit = np.concatenate([[0], (tokens == context_id).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(hit))
    return edges[::2], edges[1::2] - edges[::2]

