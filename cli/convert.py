"""`packfeed convert`: convert, then index the result when --index is given (the command composes the two stages;
neither imports the other)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packfeed.cli.options import EXIT_OK, EXIT_SKIPPED

if TYPE_CHECKING:  # the parser imports this module: the converters (PIL, pyarrow, tokenizers) load only in run()
    from packfeed.server.convert.convert import ConvertReport
    from packfeed.server.convert.internvl_meta import MetaDataset
    from packfeed.server.index.config import IndexConfig

FORMATS = ("llava", "internvl", "sharegpt", "hf-parquet", "internvl-meta")


def index_converted(out: str | Path, report: ConvertReport, config: IndexConfig, workers: int | None,
                    progress: bool) -> dict[str, Any]:
    """Index a conversion's shards into `out/index.parquet`; the summary is added to its report."""
    from packfeed.server.convert.convert import shard_paths
    from packfeed.server.index.indexer import build_index

    if not report.converted:
        raise ValueError(f"nothing to index in {out}: no row was converted (see {out}/convert-report.json)")
    result = build_index(shard_paths(out), Path(out) / "index.parquet", config, workers=workers, progress=progress)
    report.index = result.summary()
    report.write(Path(out))
    return report.index


def run(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """(what to print, whether anything was rejected or skipped)."""
    from packfeed.server.convert.convert import ConvertOptions, convert
    from packfeed.server.convert.internvl_meta import convert_meta, policy_for
    from packfeed.server.index.config import IndexConfig

    config = IndexConfig.from_args(args) if args.index else None  # bad conventions fail before converting
    shared = {"shard_size_mb": args.shard_size_mb, "workers": args.workers, "overwrite": args.overwrite,
              "progress": not args.quiet, "max_image_mb": args.max_image_mb, "max_video_mb": args.max_video_mb,
              "trust_absolute_paths": args.trust_absolute_paths}
    if args.format == "internvl-meta":
        def index(dataset: MetaDataset, report: ConvertReport) -> dict[str, Any]:
            per_dataset = dataclasses.replace(config, image_policy=policy_for(config.image_policy, dataset))
            return index_converted(report.out, report, per_dataset, args.workers, not args.quiet)

        summary = convert_meta(args.source, args.out, shared, index if config else None, base=args.image_root)
        skipped = any(d["rejected"] or _index_skipped(d.get("index")) for d in summary["datasets"].values())
        return summary, skipped
    report = convert(ConvertOptions(args.format, args.source, args.out, args.image_root,
                                    conversation_column=args.conversation_column, **shared))
    if config:
        index_converted(args.out, report, config, args.workers, not args.quiet)
    summary = {"out": report.out, "rows": report.rows, "converted": report.converted, "rejected": report.rejected,
               "rejected_by_reason": report.rejected_by_reason, "shards": len(report.shards),
               "report": str(Path(report.out) / "convert-report.json"),
               "samples_per_second": report.samples_per_second,
               "samples_per_second_per_core": report.samples_per_second_per_core, "index": report.index}
    skipped = bool(report.rejected or _index_skipped(report.index))
    if report.rejected:
        print(f"note: {report.rejected} rows rejected; every one is listed with its reason in {summary['report']}",
              file=sys.stderr)
    return summary, skipped


def _index_skipped(summary: dict[str, Any] | None) -> bool:
    """Whether indexing (its `packfeed index` summary, if it ran) left samples or shards out."""
    return bool(summary and (summary["invalid"] or summary["shard_errors"]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("format", choices=FORMATS, help="source format (internvl-meta: an InternVL meta JSON file)")
    parser.add_argument("source", help="annotation file (JSON list or JSONL), Parquet file/folder/glob, or meta JSON")
    parser.add_argument("--out", required=True, help="output folder: shards, convert-report.json (, index.parquet)")
    parser.add_argument("--image-root", help="folder relative image paths count from (default: the source's folder; "
                                             "internvl-meta: the folder its root/annotation paths count from, "
                                             "default the current directory)")
    parser.add_argument("--shard-size-mb", type=int, default=1024, help="target shard size (default 1024)")
    parser.add_argument("--max-image-mb", type=int, default=64, help="reject (and report) an image file larger than "
                                                                      "this, before reading it (default 64)")
    parser.add_argument("--max-video-mb", type=int, default=4096, help="the same for a video file (default 4096)")
    parser.add_argument("--trust-absolute-paths", action="store_true",
                        help="read absolute image paths as written, outside the image root too (default: every "
                             "path, absolute or through symlinks, must resolve inside the image root)")
    parser.add_argument("--workers", type=int, help="parallel processes (default: CPU count)")
    parser.add_argument("--conversation-column", help="hf-parquet: the conversation column (default: the first of "
                                                      "conversations, messages, texts)")
    parser.add_argument("--overwrite", action="store_true", help="replace a previous conversion in --out")
    parser.add_argument("--index", action="store_true", help="index the shards (needs --tokenizer)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def print_summary(summary: dict[str, Any]) -> None:
    print(json.dumps(summary, ensure_ascii=False))


def cmd_convert(args: argparse.Namespace) -> int:
    summary, skipped = run(args)
    print_summary(summary)
    return EXIT_SKIPPED if skipped else EXIT_OK
