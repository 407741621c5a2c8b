"""A live step in a worker: `LiveReads`, the `StepReads` of a live job (each member's spooled row by its position in
the packs), and `LiveRows` / `LiveReader`, what the pack builder reads a step's samples through in place of an
index's rows and shards (token ids as put, never re-tokenised; images from the referenced prompt's shards or from
the files that came with the sample, tiled by the dataset's image policy)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packfeed.media.chat import IGNORE_INDEX
from packfeed.server.live.rows import LiveRow
from packfeed.server.live.samples import placeholder_runs
from packfeed.server.live.spool import TOKEN_VERSIONS as SPOOLED_VERSIONS
from packfeed.server.live.spool import beside, read_array, read_member
from packfeed.server.serve.index_rows import IndexRows
from packfeed.server.serve.packs import TOKEN_VERSIONS
from packfeed.server.serve.preprocess import SampleReader, SampleTensors
from packfeed.server.serve.shard_reader import SampleSkipped

LIVE_LABEL = "live"  # a live sample's `sample_sources` entry


@dataclass
class LiveReads:
    """A rank-step's live samples for a worker (its `StepReads`): each member's row (its spool files included), by
    position, read from the spool; a prompt's images from the dataset's indexes (`datasets`, the worker's names)."""

    rows: dict[int, LiveRow]  # by position, each with its tar and share (`LiveDataset.work`)
    image_context_id: int
    tensor_names: tuple[str, ...] = ()  # the job's per-token tensors: every pack carries them, an empty one too
    # where each of the dataset's indexes starts in its prompts' numbering (`prompt_id`): a mixture has several
    offsets: tuple[int, ...] = (0,)
    datasets: tuple[str, ...] = ()
    value_names: tuple[str, ...] = ()  # the job's per-sample values: every pack carries them too

    @property
    def sources(self) -> int:
        return 1  # every member comes from the spool

    @property
    def shared_prefixes(self) -> bool:
        return True  # a row says what it shares where its step's plan shares prefixes (`LiveDataset.work`)

    def parts(self, open_index) -> list[tuple]:
        prompts = [open_index(name) for name in self.datasets]
        return [(LiveRows(self), LiveReader(prompts, self), LIVE_LABEL)]

    def prompt_of(self, prompt_id: int) -> tuple[int, int]:
        """(the index a referenced prompt is in, its sample id there)."""
        return prompt_in(self.offsets, prompt_id)

    def complete(self, pack) -> None:
        """Give a pack every live tensor the job's packs carry (an empty pack, or one a sample of which was
        skipped, has them too: a trainer reads them the same way in every step)."""
        length = len(pack.tensors["input_ids"])
        for name in self.tensor_names:
            pack.tensors.setdefault(f"token.{name}", np.zeros(length, np.float32))
        pack.tensors.setdefault("policy_version", np.zeros(len(pack.sample_keys), np.int64))
        pack.tensors.setdefault(TOKEN_VERSIONS, np.zeros(length, np.int64))
        for name in self.value_names:
            pack.tensors.setdefault(f"value.{name}", np.full(len(pack.sample_keys), np.nan))


def prompt_in(offsets: tuple[int, ...], prompt_id: int) -> tuple[int, int]:
    """(the index a referenced prompt is in, its sample id there), the dataset's indexes starting at `offsets` in
    its prompts' numbering."""
    part = int(np.searchsorted(offsets, prompt_id, side="right")) - 1
    return part, prompt_id - offsets[part]



class LiveRows:
    """A step's live rows, by the positions its packs name (what a worker asks of an index's rows)."""

    def __init__(self, live: LiveReads):
        self.live = live

    def row(self, position: int) -> LiveRow:
        return self.live.rows[int(position)]

    @staticmethod
    def key_of(row: LiveRow) -> str:
        return row.key

    def prefix_of(self, position: int) -> tuple[str, int] | None:
        """[what the sample shares its prefix with, the prefix's tokens], or None (`LiveDataset.work` says it where the
        step's plan shares prefixes)."""
        return self.live.rows[int(position)].prefix_of

    def fork_of(self, position: int) -> tuple[str, int] | None:
        """A fork's (parent's key, tokens it shares with it) where the step's plan shares prefixes, else None."""
        return self.live.rows[int(position)].fork_of

    def pixel_bytes(self, positions) -> int:
        return sum(self.live.rows[int(p)].pixel_bytes for p in np.asarray(positions).tolist())


class LiveReader:
    """Reads a live sample from the spool, its images through the readers of the indexes its prompt may be in
    (`prompts`: each index's rows and reader, in the dataset's order)."""

    def __init__(self, prompts: list[tuple[IndexRows, SampleReader]], live: LiveReads):
        self.prompts, self.live = prompts, live
        self.policy, self.path = prompts[0][1].policy, prompts[0][1].path
        # an image file decoded once however many turns or trajectories of the step carry it (by where it is
        # spooled: one place per file and batch) and how many images its sample has (its tiling depends on it)
        self._decoded: dict[tuple, object] = {}
        self.decoded = 0  # image files decoded

    # what a worker sets on every reader of a step, passed to the ones that decode
    def _set(self, name: str, value) -> None:
        for _, reader in self.prompts:
            setattr(reader, name, value)

    empty = property(lambda self: self.prompts[0][1].empty, lambda self, value: self._set("empty", value))
    decode_budget = property(lambda self: self.prompts[0][1].decode_budget,
                             lambda self, value: self._set("decode_budget", value))

    def prefetch(self, rows: list[LiveRow]) -> None:
        pass

    def load(self, row: LiveRow, seed: int = 0, epoch: int = 0, pixels: bool = True,
             own_only: bool = False) -> SampleTensors:
        """The sample as spooled; a fork with `own_only` without the images it inherits (its parent's, in the same
        pack), else its whole trajectory's."""
        tar = row.tar
        try:
            tokens = read_array(tar, row.members["tokens"]).astype(np.int32)
            mask = read_array(tar, row.members["loss_mask"]).astype(bool)
            tensors = {name: read_array(tar, row.members[name]).astype(np.float32) for name in row.tensors}
            versions = read_array(tar, row.members[SPOOLED_VERSIONS]).astype(np.int64) \
                if SPOOLED_VERSIONS in row.members else None
            if row.prompt:
                part, sample_id = self.live.prompt_of(row.prompt_id)
                rows, reader = self.prompts[part]
                items = reader.indexed_images(rows.row(sample_id), pixels)
            else:
                first = len(row.inherited) if own_only else 0
                items = [self._file_image(beside(tar, file), [offset, size], width, height, len(row.sizes),
                                          f"{row.id}.image{k}")
                         for k, ((_, file, offset, size), (width, height)) in
                         enumerate(zip(row.image_refs(), row.sizes)) if k >= first]
        except (OSError, ValueError) as error:
            raise SampleSkipped(f"live spool unreadable: {row.id}: {error}") from None
        starts = placeholder_runs(tokens, self.live.image_context_id)[0].tolist()
        starts = starts[len(starts) - len(items):]  # a fork's own images are its last
        labels = np.where(mask, tokens, IGNORE_INDEX).astype(np.int32)
        return SampleTensors(row.id, tokens, labels, [tile for item in items for tile in item.tiles],
                             [item.n_tiles for item in items], [item.tokens for item in items], starts,
                             encoded=[item.encoded for item in items if item.encoded is not None],
                             geometry=[item.geometry for item in items if item.encoded is not None],
                             kinds=[item.kind for item in items], frame_seconds=[item.seconds for item in items],
                             token_tensors=tensors, group=row.group, policy_version=row.policy_version,
                             token_versions=versions, values=dict(row.values))

    def _file_image(self, path: str, span: list[int], width: int, height: int, n_images: int, what: str):
        key = (path, span[0], span[1], n_images)
        if key not in self._decoded:
            self._decoded[key] = self.prompts[0][1].file_image(read_member(path, span), width, height, n_images, what)
            self.decoded += 1
        return self._decoded[key]
