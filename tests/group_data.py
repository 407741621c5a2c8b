"""Annotations naming groups (a prompt's answers, preference pairs), converted and indexed as a user does it:
`packfeed convert` (llava) and `packfeed index` with a tokenizer trained on the spot (internvl template)."""

from __future__ import annotations

import json
from pathlib import Path


def index_annotations(root: Path, rows: list[dict], policy: dict) -> Path:
    """`rows` (llava entries whose images lie in root/images) converted to shards and indexed with `policy`;
    returns the index."""
    from packfeed.media.chat import PRESETS
    from packfeed.server.convert.convert import ConvertOptions, convert, shard_paths
    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.indexer import build_index
    from packfeed.server.tools.demo import train_tokenizer

    (root / "a.json").write_text(json.dumps(rows))
    convert(ConvertOptions("llava", str(root / "a.json"), str(root / "shards"), str(root / "images"), workers=1,
                           progress=False))
    template = PRESETS["internvl"]
    tokenizer = train_tokenizer(root / "tokenizer.json", vocab_size=400, special_tokens=template.special_tokens)
    build_index(shard_paths(root / "shards"), root / "index.parquet", IndexConfig(str(tokenizer), policy,
                                                                                   template.to_dict()),
                workers=1, progress=False)
    return root / "index.parquet"
