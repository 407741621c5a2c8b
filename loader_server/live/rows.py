"""A live sample as the server keeps it once spooled: what the planner counts of it, what a worker reads it by,
and where its arrays lie in its batch's tar. A typed record, written to the spool as the JSON of its batch's rows
(`to_json`; the keys a spool has always held) and read back from it (`from_json`, tolerant of the keys spools
written before a field existed leave out)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from packfeed.server.live.samples import LiveSample

Span = tuple[int, int]  # [offset, size] of a member in its batch's tar
# a trajectory's fields and its media's: left out where empty (rows as spools held them before trajectories)
TRAJECTORY_FIELDS = ("turns", "turn_digests", "parent", "fork_turn", "fork_tokens", "inherited_vision", "inherited",
                     "image_digests", "media")


@dataclass(frozen=True)
class LiveRow:
    id: str
    group: str
    policy_version: int
    prompt: str  # the indexed sample whose images it uses ("": none, or its own images)
    tokens: int  # how many
    loss_tokens: int
    vision: int  # vision units
    vit_patches: float
    vit_attn_sq: float
    sizes: tuple[tuple[int, int], ...]  # (width, height) of each image
    tensors: tuple[str, ...]  # the names of its per-token tensors
    prompt_id: int  # `prompt`'s number in the job's dataset (-1: none)
    pixel_bytes: int  # of its tiles, uint8
    prefix: int = 0  # the tokens of the prefix it may share with its group
    prefix_key: str = ""  # what it shares the prefix with, within its group ("": nothing)
    digest: str = ""  # of what the producer put: a retry matches it ("": a spool from before digests)
    # in the spool: its batch, the batch's tar ("": a spool from before tars had a token) and where its
    # tokens, loss mask and tensors (`members`) and its image files (`images`) lie there
    batch: int = -1
    file: str = ""
    place: int = 0
    members: dict[str, Span] = field(default_factory=dict)
    images: tuple[Span, ...] = ()
    # what a step's work adds for the worker: where its tar is read (a path or an object URL), and what it shares
    # its prefix with where the step's plan shares prefixes ([share key, prefix tokens])
    tar: str = ""
    prefix_of: tuple[str, int] | None = None
    fork_of: tuple[str, int] | None = None  # a fork's [parent's id, shared tokens] where the plan shares them
    # asynchronous RL: its per-sample values, and of a rollout put in parts whether this part is unfinished, its
    # number and what its continuation must start with (`LiveSample.covers`); token versions are a member
    values: dict[str, float] = field(default_factory=dict)
    unfinished: bool = False
    part: int = 0
    covers: str = ""
    producer: str = ""  # who put it (`packfeed info` counts a spool's samples by producer)
    # a trajectory (docs/live.md "Trajectories"): its turns (role, tokens, images) and the digest of its tokens up
    # to each turn's end; of a fork its parent's id, the turns, tokens and vision units it shares with it, and
    # where the images it inherits there lie: (batch, tar, offset, size) each, in an ancestor's batch (`sizes`
    # are its whole trajectory's images: those, then its own files)
    turns: tuple[tuple[int, int, int], ...] = ()
    turn_digests: tuple[str, ...] = ()
    parent: str = ""
    fork_turn: int = 0
    fork_tokens: int = 0
    inherited_vision: int = 0
    inherited: tuple[tuple[int, str, int, int], ...] = ()
    # media stored once per job: each of its own image files' content digest, and those found spooled already in
    # another batch, (their number among its images, batch, tar, offset, size): `images` holds the others' spans
    image_digests: tuple[str, ...] = ()
    media: tuple[tuple[int, int, str, int, int], ...] = ()

    @classmethod
    def spooled(cls, sample: LiveSample, batch: int, file: str, place: int, members: dict[str, Span],
                images: list[Span], inherited: list[tuple[int, str, int, int]] = (), digests: list[str] = (),
                media: list[tuple[int, int, str, int, int]] = ()) -> LiveRow:
        return cls(sample.id, sample.group, sample.policy_version, sample.prompt, sample.n_tokens,
                   sample.loss_tokens, sample.vision, sample.vit_patches, sample.vit_attn_sq,
                   tuple(tuple(size) for size in sample.sizes), tuple(sorted(sample.tensors)), sample.prompt_id,
                   sample.pixel_bytes, sample.prefix, sample.prefix_key, sample.digest, batch, file, place,
                   {name: tuple(span) for name, span in members.items()}, tuple(tuple(span) for span in images),
                   values=dict(sample.values), unfinished=sample.unfinished, part=sample.part, covers=sample.covers,
                   producer=sample.producer, turns=tuple(sample.turns), turn_digests=tuple(sample.turn_digests),
                   parent=sample.parent, fork_turn=sample.fork_turn, fork_tokens=sample.fork_tokens,
                   inherited_vision=sample.inherited_vision, inherited=tuple(inherited), image_digests=tuple(digests),
                   media=tuple(media))

    def own_image_refs(self) -> list[tuple[int, str, int, int]]:
        """Where each of its own image files lies, in order: (batch, tar, offset, size)."""
        elsewhere = {k: tuple(ref) for k, *ref in self.media}
        here = iter(self.images)
        return [elsewhere[k] if k in elsewhere else (self.batch, self.file, *next(here))
                for k in range(len(self.images) + len(self.media))]

    def image_refs(self) -> list[tuple[int, str, int, int]]:
        """Where every image of its whole trajectory lies, in order: (batch, tar, offset, size)."""
        return [*self.inherited, *self.own_image_refs()]

    def inherited_batches(self) -> dict[int, str]:
        """The batches besides its own holding images it reads, with their tars' names: they stay until it is
        consumed."""
        held = {batch: file for batch, file, *_ in self.inherited} | {batch: file for _, batch, file, *_ in self.media}
        held.pop(self.batch, None)
        return held

    def batches(self) -> dict[int, str]:
        """Every batch it reads (its own and `inherited_batches`), with their tars' names."""
        return {**self.inherited_batches(), self.batch: self.file}

    @property
    def key(self) -> str:
        """The sample's key in its packs (`sample_keys`): its id."""
        return self.id

    def to_json(self) -> dict[str, Any]:
        """Its entry in its batch's rows file (`key` and `n_images` beside the fields: the spool's keys since
        its first version)."""
        out = dataclasses.asdict(self)
        del out["tar"], out["prefix_of"], out["fork_of"]
        for name, default in (("values", {}), ("unfinished", False), ("part", 0), ("covers", ""), ("producer", ""),
                              *((name, self.__dataclass_fields__[name].default) for name in TRAJECTORY_FIELDS)):
            if out[name] == default:  # rows as spools held them before asynchronous RL
                del out[name]
        return {**out, "key": self.id, "n_images": len(self.sizes)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LiveRow:
        known = {f.name for f in dataclasses.fields(cls)} - {"tar", "prefix_of", "fork_of"}
        values = {name: value for name, value in raw.items() if name in known}
        values["sizes"] = tuple(tuple(size) for size in values["sizes"])
        values["tensors"] = tuple(values["tensors"])
        values["images"] = tuple(tuple(span) for span in values.get("images", ()))
        values["members"] = {name: tuple(span) for name, span in values.get("members", {}).items()}
        for name in ("turns", "inherited", "media"):
            values[name] = tuple(tuple(item) for item in values.get(name, ()))
        for name in ("turn_digests", "image_digests"):
            values[name] = tuple(values.get(name, ()))
        return cls(**values)
