"""Per-sample loads and the compute cost model the planner balances on.

Cost of a sample on a module = a * tokens + b * sum(sequence_length^2): linear layers plus attention, with
the coefficients of the job's `CostModel` (part of the plan settings, `packfeed.v1.options`). Packs use
variable-length attention, so samples in a pack never attend to each other and pack costs are plain sums
of sample costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import pyarrow.parquet as pq

from packfeed.media.image_policy import DEFAULT_PATCHES_PER_UNIT
from packfeed.media.jit import kernel, prange
from packfeed.server.index.table import IndexInfo, encoder_columns, read_index_info
from packfeed.v1.options import CostModel


def sample_costs(model: CostModel, loads: "SampleLoads") -> np.ndarray:
    """(n, 2 + E) float32: [vision cost, LLM cost, then each further encoder's cost in name order] of every
    sample under `model`, one row per sample so that summing a pack touches one cache line per member."""
    llm_sq = getattr(loads, "llm_attn_sq", None)
    costs = _cost_rows(loads.vit_patches, loads.vit_attn_sq, loads.tokens,
                       np.full(1, np.nan, np.float32) if llm_sq is None else llm_sq, model.vision_linear,
                       model.vision_quadratic, model.llm_linear, model.llm_quadratic)
    encoders = getattr(loads, "encoders", None) or {}
    if not encoders:
        return costs
    extra = [np.float32(model.encoder(name)[0]) * encoders[name].tokens
             + np.float32(model.encoder(name)[1]) * encoders[name].attn_sq for name in sorted(encoders)]
    return np.column_stack([costs, *extra]).astype(np.float32, copy=False)


def encoder_costs(costs: np.ndarray) -> np.ndarray:
    """Every encoder's cost together per row of `sample_costs` (all columns but the LLM's): what runs before the
    LLM when each sample is encoded where it trains."""
    return costs[:, 0] if costs.shape[1] == 2 else costs.sum(axis=1) - costs[:, 1]


def encoder_names(loads) -> list[str]:
    """The further encoders of `loads`, in the order of `sample_costs`' columns 2, 3, ..."""
    return sorted(getattr(loads, "encoders", None) or {})


@kernel(cache=True, nogil=True, parallel=True)
def _cost_rows(patches, attn_sq, tokens, llm_sq, a_v, b_v, a_l, b_l):
    """`llm_sq`: the LLM's attention squares per row where they are not tokens^2 (NaN or a one-element array:
    tokens^2), as for a group's members sharing their prefix (`packfeed.server.plan.groups`)."""
    out = np.empty((len(tokens), 2), dtype=np.float32)
    given = len(llm_sq) == len(tokens)
    for i in prange(len(tokens)):
        t = float(tokens[i])
        square = t * t
        if given and not np.isnan(llm_sq[i]):
            square = float(llm_sq[i])
        out[i, 0] = a_v * patches[i] + b_v * attn_sq[i]
        out[i, 1] = a_l * t + b_l * square
    return out


@dataclass(frozen=True)
class EncoderLoads:
    """A further encoder's columns (an audio or video tower beside the vision encoder), float32 per sample."""

    tokens: np.ndarray  # its sequence tokens: its linear cost, and what its output weighs
    attn_sq: np.ndarray  # the sum of its sequences' squared lengths: its attention cost
    padded: bool = False  # it pads a batch's sequences (one per sample) to the longest

    def subset(self, ids: np.ndarray) -> "EncoderLoads":
        return EncoderLoads(self.tokens[ids], self.attn_sq[ids], self.padded)


@dataclass
class SampleLoads:
    """Columns of the index the planner needs, as numpy arrays (row i = sample_id i)."""

    valid: np.ndarray  # bool
    vision: np.ndarray  # int32 vision units (what the vision cap counts)
    tokens: np.ndarray  # int32 LLM tokens (what the token cap counts)
    vit_patches: np.ndarray  # float32, cost model only
    vit_attn_sq: np.ndarray  # float32, cost model only
    encoders: dict[str, EncoderLoads] = field(default_factory=dict)  # further encoders, by name (cost model only)
    # uint8 bits of the towers a sample calls (`packfeed.server.plan.collective.TOWER_BITS`: 1 images, 2 videos);
    # None: images wherever there are vision units (lengths imported without media counts)
    towers: np.ndarray | None = None
    # Groups (`packfeed.server.plan.groups`): per sample, its group (-1: none) and the tokens of the prefix it
    # shares with its group (the prompt, its images among them); None: no groups
    group: np.ndarray | None = None
    prefix: np.ndarray | None = None
    # float32 per sample: the LLM's attention squares where they are not tokens^2 (NaN: tokens^2); None: all are
    llm_attn_sq: np.ndarray | None = None
    # Trees (`packfeed.server.plan.trees`): per sample, the sample it continues (-1: none; `prefix` then the
    # tokens it shares with it) and the vision units of the images it inherits there; None: no trees
    parent: np.ndarray | None = None
    shared_vision: np.ndarray | None = None
    # ... and of a tree's trajectories their prompt's tokens and vision units (what one-level sharing would share:
    # `packfeed.server.plan.trees.one_level`); None: not known
    prompt: np.ndarray | None = None
    prompt_vision: np.ndarray | None = None

    def __post_init__(self):
        if self.towers is None:
            self.towers = (np.asarray(self.vision) > 0).astype(np.uint8)

    def __len__(self) -> int:
        return len(self.valid)

    def gather(self, ids: np.ndarray, names=("valid", "vision", "tokens", "vit_patches", "vit_attn_sq", "towers")) -> dict:
        """Columns `names` at samples `ids`, in that order (as MappedLoads.gather, for loads in memory)."""
        return {name: getattr(self, name)[ids] for name in names}

    def subset(self, ids: np.ndarray) -> "SampleLoads":
        """The loads of samples `ids`, in that order."""
        optional = tuple(name for name in ("group", "prefix", "llm_attn_sq", "shared_vision")
                         if getattr(self, name) is not None)
        out = SampleLoads(**self.gather(ids, ("valid", "vision", "tokens", "vit_patches", "vit_attn_sq", "towers")
                                        + optional),
                          encoders={name: e.subset(ids) for name, e in self.encoders.items()})
        if self.parent is not None:  # a parent by its place among `ids` (-1: not among them)
            place = np.full(len(self.valid), -1, np.int64)
            place[np.asarray(ids)] = np.arange(len(ids))
            parent = np.asarray(self.parent, np.int64)[ids]
            out.parent = np.where(parent >= 0, place[np.maximum(parent, 0)], -1)
        return out

    @classmethod
    def from_arrays(cls, vision, tokens, valid=None, patches_per_unit: int = DEFAULT_PATCHES_PER_UNIT) -> "SampleLoads":
        """Loads from bare vision-unit and token counts, taking each unit as one ViT sequence (InternVL tiles)."""
        vision = np.asarray(vision, dtype=np.int32)
        tokens = np.asarray(tokens, dtype=np.int32)
        valid = np.ones(len(vision), dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
        patches = vision.astype(np.float32) * patches_per_unit
        return cls(valid, vision, tokens, patches, patches * patches_per_unit)


def check_sample_ids(parquet: pq.ParquetFile, index_path) -> None:
    """sample_id must run 0..n-1 in row order. Checked from row-group statistics, without reading the column:
    each group must start where the previous one ended and span exactly its rows."""
    expected = 0
    column = parquet.schema_arrow.get_field_index("sample_id")
    for g in range(parquet.metadata.num_row_groups):
        group = parquet.metadata.row_group(g)
        stats = group.column(column).statistics
        rows = group.num_rows
        if rows and (stats is None or not stats.has_min_max or stats.min != expected
                     or stats.max != expected + rows - 1 or stats.null_count):
            raise ValueError(f"{index_path}: sample_id must equal the row number; rebuild the index with "
                             "`packfeed index`")
        expected += rows


def load_sample_loads(index_path: str | Path) -> tuple[SampleLoads, IndexInfo]:
    """The planner's columns as compact arrays (17 bytes per sample; a grouped index's 12 more)."""
    info = read_index_info(index_path)
    # Memory-mapped and one column at a time: the whole Arrow table would take 3.3 GB at 100M rows, and
    # memory Arrow's allocator once held is not handed back to the planner.
    parquet = pq.ParquetFile(index_path, memory_map=True)

    def column(name, dtype):
        return parquet.read(columns=[name]).column(0).to_numpy(zero_copy_only=False).astype(dtype, copy=False)

    check_sample_ids(parquet, index_path)
    encoders = {name: EncoderLoads(*(column(c, np.float32) for c in encoder_columns(name)), bool(spec["padded"]))
                for name, spec in (info.encoders or {}).items()}
    vision = column("vision_units", np.int32)
    present = [c for c in TOWER_COLUMNS if c in parquet.schema_arrow.names]
    batches = parquet.iter_batches(batch_size=1 << 20, columns=present) if present else ()
    parts, start = [], 0
    for batch in batches:  # a batch at a time: the three columns whole would take 16 bytes a sample
        parts.append(index_towers(batch, vision[start:start + batch.num_rows]))
        start += batch.num_rows
    towers = np.concatenate(parts) if parts else None
    groups = {"group": column("group", np.int64), "prefix": column("prefix_tokens", np.int32)} if info.groups else {}
    loads = SampleLoads(valid=column("valid", bool), vision=vision,
                        tokens=column("llm_tokens", np.int32), vit_patches=column("vit_patches", np.float32),
                        vit_attn_sq=column("vit_attn_sq", np.float32), encoders=encoders, towers=towers, **groups)
    if info.trees:  # each fork continuing its parent (`packfeed.server.plan.trees`)
        from packfeed.server.index.trajectory_lengths import with_trees

        with_trees(loads, tuple(column(name, np.int64) for name in ("parent", "fork_tokens", "fork_vision",
                                                                     "prompt_vision")), loads.prefix)
    return loads, info


TOWER_COLUMNS = ("n_images", "n_videos", "frames_fps")  # the index columns `index_towers` reads


def index_towers(table, vision: np.ndarray) -> np.ndarray:
    """Every row's tower bits from the index's media counts (an Arrow table or record batch of TOWER_COLUMNS):
    images unless its images are one video's frames, videos when it has any. Rows whose counts are unknown
    (lengths imported without them) call the image tower when they have vision units."""
    names = table.schema.names

    def counts(name):
        if name not in names:
            return np.full(table.num_rows, np.nan)
        return table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)  # nulls as NaN

    n_images, n_videos = counts("n_images"), counts("n_videos")
    frames = table.column("frames_fps").is_valid().to_numpy(zero_copy_only=False) if "frames_fps" in names \
        else np.zeros(table.num_rows, dtype=bool)
    images = np.where(np.isnan(n_images), np.asarray(vision) > 0, (n_images > 0) & ~frames)
    return (images.astype(np.uint8) | ((n_videos > 0).astype(np.uint8) << 1)).astype(np.uint8)
