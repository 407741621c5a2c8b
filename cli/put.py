"""`packfeed put TARGET --job JOB FILE.jsonl ...`: a JSON-lines file's samples into a live job, for offline
rollouts, preference data and operators. Durable when it returns; prints what it put and what was refused
(line, field, reason) and exits with 3 when a line was refused, as `packfeed index` does for samples left out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from packfeed.cli.options import EXIT_OK, EXIT_SKIPPED


def cmd_put(args: argparse.Namespace) -> int:
    from packfeed.client.stream.channel import PackfeedError
    from packfeed.client.stream.producer import Producer, Sample

    if args.batch < 1:
        raise ValueError("--batch must be >= 1")
    if (args.dataset or args.seed) and not args.plan:
        raise ValueError("--dataset and --seed open the job with --plan: give the trainers' plan too")
    refused, put, duplicates = [], 0, 0
    opening = dict(plan=read_plan(args.plan), dataset=args.dataset, seed=args.seed) if args.plan else {}
    with Producer(args.target.split(","), job=args.job, on_refused="return", batch_samples=args.batch,
                  open_wait_s=args.wait_open, producer_token=args.producer_token, **opening) as producer:
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


def read_plan(text: str):
    """--plan: a YAML/JSON file of PlanConfig fields, or the mapping itself."""
    import yaml

    from packfeed.v1.options import PlanConfig

    path = Path(text)
    raw = yaml.safe_load(path.read_text() if path.is_file() else text)
    if not isinstance(raw, dict):
        raise ValueError(f"--plan {text!r}: give a file of PlanConfig fields or a mapping such as "
                         "'{dp: 2, live: true, step_samples: 8}'")
    try:
        return PlanConfig.from_dict(raw)
    except TypeError as error:
        raise ValueError(f"--plan: {error}: give PlanConfig fields (docs/live.md)") from None


def _send(producer, batch, path, refused, put, duplicates) -> tuple[int, int]:
    from packfeed.client.stream.channel import PackfeedError

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
