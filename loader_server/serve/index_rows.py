"""The index columns serving reads (`IndexRows`): per sample, where its members lie in its shard, their sizes and
checksums, its images' and videos' sizes and its token counts, memory-mapped and shared by the server and
every worker."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def _mapped_columns(index: Path, fingerprint: str) -> pa.Table:
    """SERVE_COLUMNS of the index, memory-mapped from their Arrow file (made first when missing)."""
    from packfeed.server.index.table import read_index

    mapped = index.with_name(f"{index.stem}.{fingerprint[:16]}.serve.arrow")
    if not mapped.exists():
        from packfeed.server.index.table import GROUP_COLUMNS, read_index_info

        info = read_index_info(index)
        grouped = (list(GROUP_COLUMNS) if info.groups else []) + (TREE_SERVE_COLUMNS if info.trees else [])
        table = read_index(index, columns=SERVE_COLUMNS + grouped)[0].combine_chunks()
        partial = mapped.with_name(f"{mapped.name}.{os.getpid()}.partial")
        try:
            with pa.OSFile(str(partial), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table, max_chunksize=1 << 20)
            os.replace(partial, mapped)
        except OSError:  # a read-only folder: keep the columns in memory
            partial.unlink(missing_ok=True)
            return table
    return pa.ipc.open_file(pa.memory_map(str(mapped))).read_all()  # chunks of 1M rows, left as they lie


SERVE_COLUMNS = ["key", "shard", "valid", "reason", "json_offset", "json_size", "json_checksum", "image_names",
                 "image_offsets", "image_sizes", "image_checksums", "image_widths", "image_heights", "n_images",
                 "llm_tokens", "loss_tokens", "n_videos", "video_names", "video_offsets", "video_sizes",
                 "video_checksums", "video_widths", "video_heights", "video_frames", "video_rates", "video_sampled",
                 "frames_fps", "pixel_bytes"]
TREE_SERVE_COLUMNS = ["parent", "fork_tokens"]  # an index of trees: what each fork continues


class IndexRows:
    """The index columns serving needs, as Arrow columns; rows come out as dicts.

    They are read from an uncompressed Arrow file beside the index (`INDEX.<fingerprint>.serve.arrow`, written
    once by whichever process needs it first), memory-mapped: the server and every worker share one copy in the
    page cache instead of each decompressing the Parquet columns into memory of its own. Where the index's
    folder is not writable, the columns are read into memory as before."""

    def __init__(self, index_path):
        from packfeed.server.index.table import read_index_info

        self.info = read_index_info(index_path)
        self.table = _mapped_columns(Path(index_path), self.info.fingerprint)

    def row(self, sample_id: int) -> dict:
        return self.table.slice(int(sample_id), 1).to_pylist()[0]

    @staticmethod
    def key_of(row: dict) -> str:
        """The sample key of a row `row()` gave."""
        return row["key"]

    def prefix_of(self, sample_id: int) -> list | None:
        """[what the sample shares its prefix with, the prefix's tokens] (a grouped index: each group one prompt,
        `packfeed.server.index.sample_costs`), or None."""
        if not self.info.groups or self.info.trees:  # in an index of trees, a sample shares only as a fork
            return None
        group = self.table.column("group")[int(sample_id)].as_py()
        return [str(group), self.table.column("prefix_tokens")[int(sample_id)].as_py()] if group >= 0 else None

    def fork_of(self, sample_id: int) -> tuple[str, int] | None:
        """What a fork continues in an index of trees (`packfeed.server.index.trajectories`; a group sharing one
        prompt is one there): its parent's key and the tokens it shares with it; None for any other sample."""
        if not self.info.trees:
            return None
        parent = self.table.column("parent")[int(sample_id)].as_py()
        if parent < 0:
            return None
        return self.table.column("key")[parent].as_py(), self.table.column("fork_tokens")[int(sample_id)].as_py()

    def _take(self, name: str, sample_ids) -> pa.Array:
        """Column `name` at `sample_ids`, read from the mapped file: per step, never a whole column in memory
        (a per-sample array in each process would be 4-8 bytes a sample, 400-800 MB at 100M samples)."""
        return self.table.column(name).take(pa.array(np.asarray(sample_ids, dtype=np.int64)))

    def largest_image_pixels(self, sample_ids) -> int:
        """The most pixels a worker holds decoded at once for any of `sample_ids`: width x height of their largest
        image or video frame (frames are decoded and resized one at a time); 0 for text only."""
        return max(self._largest("image_widths", "image_heights", sample_ids),
                   self._largest("video_widths", "video_heights", sample_ids))

    def _largest(self, widths_name: str, heights_name: str, sample_ids) -> int:
        widths, heights = (pc.list_flatten(self._take(name, sample_ids)) for name in (widths_name, heights_name))
        if not len(widths):
            return 0
        return int(pc.max(pc.multiply(pc.cast(widths, pa.int64()), pc.cast(heights, pa.int64()))).as_py() or 0)

    def samples_with_videos(self) -> int:
        """How many samples of the index hold a video."""
        return int(pc.sum(pc.greater(self.table.column("n_videos"), 0)).as_py() or 0)

    def pixel_bytes(self, sample_ids) -> int:
        """uint8 bytes of the tiles of `sample_ids` together, as the index computed them."""
        return int(pc.sum(self._take("pixel_bytes", sample_ids)).as_py() or 0)

    def loss_tokens(self, sample_ids) -> int:
        """Loss tokens of `sample_ids` together."""
        return int(pc.sum(self._take("loss_tokens", sample_ids)).as_py() or 0)
