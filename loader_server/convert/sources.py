"""Reading the annotation formats VLM teams keep: each yields `SourceRow`s in source order.

- llava:      a JSON list of {id, image | images, video | videos, conversations: [{from, value}]} (videos: files
              `<video>` tags take, as LLaVA-Video and InternVL's video annotations write them)
- internvl:   JSONL, one such object per line (InternVL's annotation files)
- sharegpt:   a JSON list or JSONL of {id?, images?, messages: [{role, content}]}, content a string or a list of
              parts ({"type": "text", "text": ...} / {"type": "image"} / {"type": "video"}); `conversations` of
              {from, value} too
- hf-parquet: Parquet files as Hugging Face datasets store them: `images: list<struct<bytes, path>>` plus a
              conversation column (`conversations`, `messages`, or the_cauldron's `texts` of {user, assistant})

An entry's `group` (the JSON formats; a string or an integer) names the samples that share a prompt (preference
pairs, the branches of a conversation, a prompt's responses): it goes into the sample's JSON, which the indexer
reads (docs/planning.md "Groups"). An entry's `parent` (the `id` of an earlier entry) and `fork_turn` (k) make it a
trajectory continuing that one from its turn k on: it still holds its whole conversation and every image (its
first k turns are its parent's), and the index plans and serves those turns once (docs/planning.md "Trees").

A row that cannot be read at all (a line that is not JSON, an entry that is not an object) still becomes a
SourceRow, with its `error`, so the report lists it and the position stays stable.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from packfeed.media.conversation import IMAGE_TAG, VIDEO_TAG, ConversationError

CONVERSATION_COLUMNS = ("conversations", "messages", "texts")


@dataclass
class SourceImage:
    path: str | None = None  # as the annotation wrote it
    data: bytes | None = None  # bytes stored in the source (Parquet)


@dataclass
class SourceRow:
    position: int  # 0-based row (list entry, line, Parquet row) in source order across all source files
    id: str | None
    turns: Any = None  # the conversation as the source has it; normalized by `normalize_turns`
    images: list[SourceImage] = field(default_factory=list)
    videos: list[SourceImage] = field(default_factory=list)  # video files, by path
    error: str | None = None
    group: Any = None  # the annotation's `group`: samples sharing a prompt (docs/planning.md "Groups")
    fork: dict[str, Any] = field(default_factory=dict)  # its `parent` and `fork_turn` (docs/planning.md "Trees")


def normalize_turns(raw: Any) -> list[dict[str, str]]:
    """Any supported conversation shape as LLaVA `conversations` ([{"from", "value"}]), or ConversationError."""
    if not isinstance(raw, list):
        raise ConversationError("conversation is not a list of turns")
    turns: list[dict[str, str]] = []
    for k, turn in enumerate(raw):
        if not isinstance(turn, dict):
            raise ConversationError(f"turn {k} is not an object")
        if "from" in turn or "value" in turn:
            turns.append({"from": turn.get("from"), "value": turn.get("value")})
        elif "role" in turn:
            turns.append({"from": turn["role"], "value": _content_text(turn.get("content"), k)})
        elif "user" in turn or "assistant" in turn:  # the_cauldron: one {user, assistant} pair per entry
            turns += [{"from": "user", "value": turn.get("user")}, {"from": "assistant", "value": turn.get("assistant")}]
        else:
            raise ConversationError(f"turn {k} has neither from/value, role/content nor user/assistant")
    return turns


def _content_text(content: Any, k: int) -> Any:
    """A message's content: a string, or parts where each image part becomes an <image> tag."""
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("image", "video"):
            parts.append(IMAGE_TAG if kind == "image" else VIDEO_TAG)
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise ConversationError(f"turn {k}: content part {part!r:.80} is neither text, image nor video")
    return "\n".join(parts)


def _path_list(entry: dict[str, Any], kind: str) -> list[SourceImage] | str:
    """`image` (one path) or `images` (a list of paths) of an annotation entry, or `video` / `videos`; a string
    error when malformed."""
    raw = entry.get(f"{kind}s", entry.get(kind))
    if raw is None:
        return []
    paths = [raw] if isinstance(raw, str) else raw
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        return f"{kind} field is neither a path nor a list of paths"
    return [SourceImage(path=p) for p in paths]


def _annotation_row(position: int, entry: Any, turns_keys: tuple[str, ...]) -> SourceRow:
    if not isinstance(entry, dict):
        return SourceRow(position, None, error=f"entry is a {type(entry).__name__}, not an object")
    raw_id = entry.get("id")
    turns = next((entry[key] for key in turns_keys if key in entry), None)
    row = SourceRow(position, None if raw_id is None else str(raw_id), turns=turns, group=entry.get("group"),
                    fork={name: entry[name] for name in ("parent", "fork_turn") if name in entry})
    images, videos = _path_list(entry, "image"), _path_list(entry, "video")
    for found in (images, videos):
        if isinstance(found, str):
            row.error = found
    if row.error is None:
        row.images, row.videos = images, videos
    return row


def _json_entries(path: Path) -> Iterator[tuple[Any, str | None]]:
    """(entry, error) of a JSON list file or a JSONL file (detected from the first character)."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"["):
        try:
            entries = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path}: not a valid JSON list ({error}); JSONL files hold one object per line") from None
        if not isinstance(entries, list):
            raise ValueError(f"{path}: expected a JSON list of samples")
        yield from ((entry, None) for entry in entries)
        return
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line), None
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                yield None, f"line {number}: not JSON ({error})"


def read_annotations(path: str | Path, turns_keys: tuple[str, ...]) -> Iterator[SourceRow]:
    """LLaVA JSON, InternVL JSONL and ShareGPT files alike (they differ in the conversation key)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"annotation file {path} not found")
    for position, (entry, error) in enumerate(_json_entries(path)):
        yield SourceRow(position, None, error=error) if error else _annotation_row(position, entry, turns_keys)


def parquet_files(source: str | Path) -> list[str]:
    source = str(source)
    if os.path.isdir(source):
        files = sorted(glob.glob(os.path.join(source, "**", "*.parquet"), recursive=True))
    else:
        files = sorted(glob.glob(source)) if glob.has_magic(source) else [source]
    if not files or not all(os.path.isfile(f) for f in files):
        raise FileNotFoundError(f"no Parquet files at {source}")
    return files


def read_hf_parquet(source: str | Path, conversation_column: str | None = None,
                    batch_rows: int = 256) -> Iterator[SourceRow]:
    """Rows of Hugging Face Parquet files: `images` (list<struct<bytes, path>>), a conversation column, `id`
    when present (otherwise the file name and row number are the id)."""
    import pyarrow.parquet as pq

    position = 0
    for path in parquet_files(source):
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        column = conversation_column or next((c for c in CONVERSATION_COLUMNS if c in names), None)
        if column not in names:
            raise ValueError(f"{path}: no conversation column ({', '.join(CONVERSATION_COLUMNS)}, or name one with "
                             f"--conversation-column); columns are {', '.join(names)}")
        columns = [c for c in (column, "images", "id") if c in names]
        stem = Path(path).stem
        for batch in parquet.iter_batches(batch_size=batch_rows, columns=columns):
            data = batch.to_pydict()
            for k in range(batch.num_rows):
                raw_id = data["id"][k] if "id" in data else f"{stem}-{position}"
                row = SourceRow(position, str(raw_id), turns=data[column][k])
                images = data.get("images", [None] * batch.num_rows)[k] or []
                if not isinstance(images, list) or not all(isinstance(i, dict) for i in images):
                    row.error = "images column is not a list of {bytes, path}"
                else:
                    row.images = [SourceImage(path=i.get("path"), data=i.get("bytes")) for i in images]
                yield row
                position += 1


FORMATS: dict[str, Callable[..., Iterator[SourceRow]]] = {
    "llava": lambda source, **_: read_annotations(source, ("conversations",)),
    "internvl": lambda source, **_: read_annotations(source, ("conversations",)),
    "sharegpt": lambda source, **_: read_annotations(source, ("messages", "conversations")),
    "hf-parquet": lambda source, conversation_column=None, **_: read_hf_parquet(source, conversation_column),
}
