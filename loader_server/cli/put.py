"""`packfeed put TARGET --job JOB FILE.jsonl ...`: a JSON-lines file's samples into a live job, for offline
rollouts, preference data and operators. Durable when it returns; prints what it put and what was refused
(line, field, reason) and exits with 3 when a line was refused, as `packfeed index` does for samples left out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from packfeed.server.cli.options import EXIT_OK, EXIT_SKIPPED


def cmd_put(args: argparse.Namespace) -> int:
    from packfeed.client.channel import PackfeedError
    from packfeed.client.producer import Producer, Sample

    if args.batch < 1:
        raise ValueError("--batch must be >= 1")
    refused, put, duplicates = [], 0, 0
    with Producer(args.target, job=args.job, on_refused="return", batch_samples=args.batch) as producer:
        for path in args.files:
            batch: list[tuple[int, Sample]] = []
            for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    batch.append((number, Sample.of(json.loads(line), base=Path(path).parent)))
                except (ValueError, TypeError, OSError) as error:
                    refused.append((path, number, "line", str(error)))
                    continue
                if len(batch) >= args.batch:
                    put, duplicates = _send(producer, batch, path, refused, put, duplicates)
                    batch = []
            put, duplicates = _send(producer, batch, path, refused, put, duplicates)
        if args.end:
            try:
                producer.end()
            except PackfeedError as error:
                raise ValueError(f"ending job {args.job!r}: {error}") from None
    print(json.dumps({"put": put, "duplicates": duplicates, "refused": len(refused), "ended": bool(args.end)}))
    for path, number, field, reason in refused:
        print(f"refused: {path}:{number}: {field}: {reason}", file=sys.stderr)
    return EXIT_SKIPPED if refused else EXIT_OK


def _send(producer, batch, path, refused, put, duplicates) -> tuple[int, int]:
    from packfeed.client.channel import PackfeedError

    if not batch:
        return put, duplicates
    try:
        results = producer.put([sample for _, sample in batch])
    except PackfeedError as error:
        raise ValueError(f"{path}: the server refused the put: {error}") from None
    for (number, _), result in zip(batch, results):
        if not result.accepted:
            refused.append((path, number, result.field, result.reason))
        put += result.accepted and not result.duplicate
        duplicates += result.duplicate
    return put, duplicates
