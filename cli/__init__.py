"""`packfeed`, the command line: index, convert, plan, stats, info, serve, health, train, simulate, warmup,
calibrate, demo.
The parser is built here; each command runs in `commands` (or `convert`), importing its stage only when run."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from packfeed.cli.commands import (cmd_calibrate, cmd_demo, cmd_health, cmd_index, cmd_info, cmd_plan, cmd_serve,
                                   cmd_simulate, cmd_stats, cmd_train, cmd_warmup)
from packfeed.cli.put import cmd_put
from packfeed.cli.convert import add_arguments as add_convert_arguments, cmd_convert
from packfeed.cli.options import EXIT_USAGE, add_index_options, add_plan_options
from packfeed.v1.options import PixelMode


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="packfeed", description="Balanced packs for vision-language training.")
    sub = parser.add_subparsers(dest="command", required=True)

    index = sub.add_parser("index", help="build a Parquet index of a WebDataset (or import length files)")
    index.add_argument("shards", nargs="*", help="tar shards: paths, globs, brace patterns, pipe:/URL sources")
    index.add_argument("--from-lengths", nargs="+", metavar="FILE.json", help="import OmniBal/InternVL length files")
    index.add_argument("--encoder", action="append", metavar="NAME[:padded]",
                       help="with --from-lengths: a further encoder whose costs the records give as NAME_tokens "
                            "(and NAME_items, default 1); :padded when it pads each batch to its longest sequence")
    index.add_argument("--out", required=True, help="output INDEX.parquet")
    index.add_argument("--workers", type=int, default=None, help="parallel shard readers (default: CPU count)")
    index.add_argument("--quiet", action="store_true", help="no progress bar")
    index.add_argument("--ray", metavar="ADDRESS", help="index shards as tasks on the Ray cluster at ADDRESS "
                                                        "(host:port), or 'local' for a Ray instance of this run")
    add_index_options(index)
    index.set_defaults(func=cmd_index)

    convert = sub.add_parser("convert", help="LLaVA / InternVL / ShareGPT annotations or HF Parquet -> shards "
                                             "(+ index with --index; internvl-meta: + mixture.yaml)")
    add_convert_arguments(convert)
    add_index_options(convert)
    convert.set_defaults(func=cmd_convert)

    plan = sub.add_parser("plan", help="plan balanced packs for one epoch")
    plan.add_argument("--index", help="the dataset's index (or --mixture)")
    plan.add_argument("--mixture", metavar="MIXTURE.yaml", help="plan a mixture of datasets (name, datasets: "
                                                                "{NAME: {index, repeat}}); plan rows get a dataset column")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--epoch", type=int, default=0)
    plan.add_argument("--out", help="plan.parquet (one row per sample)")
    add_plan_options(plan)
    plan.set_defaults(func=cmd_plan)

    stats = sub.add_parser("stats", help="HTML/Markdown/JSON statistics report of an index or a mixture")
    stats.add_argument("--index", help="the dataset's index (or --mixture)")
    stats.add_argument("--mixture", metavar="MIXTURE.yaml", help="report on a mixture's first epoch, per dataset")
    stats.add_argument("--out", required=True, help="report directory")
    stats.add_argument("--seed", type=int, default=0)
    stats.add_argument("--gpus", type=int, help="with --step-seconds: the loader cores and memory per GPU the "
                                                "dataset needs, per pixel mode (DP ranks x pipeline stages; DP "
                                                "defaults to GPUs / stages)")
    stats.add_argument("--step-seconds", type=float, help="the training step's seconds the loaders must keep up with")
    add_plan_options(stats)
    stats.set_defaults(func=cmd_stats)

    info = sub.add_parser("info", help="a quick look at an index, a mixture, a directory or shards before training")
    info.add_argument("paths", nargs="+", metavar="PATH", help="INDEX.parquet, MIXTURE.yaml, a directory, or shards")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=cmd_info)

    serve = sub.add_parser("serve", help="stream balanced packs to trainer ranks over gRPC")
    serve.add_argument("--config", help="YAML/JSON server config (see packfeed.server.serve.config); env PACKFEED_* "
                                        "overrides it, flags override both")
    serve.add_argument("--index", help="serve this index (a dataset named after its directory, or --dataset)")
    serve.add_argument("--dataset", help="name for --index's dataset")
    serve.add_argument("--mixture", metavar="MIXTURE.yaml", help="serve a mixture of indexes, named by its `name:`")
    serve.add_argument("--tokenizer", help="tokenizer.json (default: the one recorded in the index)")
    serve.add_argument("--shard-root", help="directory holding the shards (default: paths recorded in the index)")
    serve.add_argument("--listen", help="host:port (default 127.0.0.1:50051)")
    serve.add_argument("--metrics-port", help="Prometheus /metrics port or range FIRST-LAST (default: off)")
    serve.add_argument("--workers", type=int, help="pre-processing processes (default: CPU count - 1)")
    serve.add_argument("--prefetch-steps", type=int, help="steps prepared ahead per rank (default 4)")
    serve.add_argument("--memory-budget-mb", type=int, help="prepared packs held in memory (default 2048)")
    serve.add_argument("--live-spool", metavar="DIR", help="serve live jobs (PlanConfig live), keeping their put "
                       "samples in DIR until consumed (a folder another server may share)")
    serve.add_argument("--live-spool-max-gb", type=float, help="what the live spool may hold; producers wait "
                       "beyond it (default 50; 0: no bound)")
    serve.add_argument("--live-max-samples", type=int, help="samples a live job holds unconsumed (their rows are "
                       "in memory, ~1.5 KB each); producers wait beyond it (default 1,000,000; 0: no bound)")
    serve.add_argument("--log-level", default="INFO")
    serve.set_defaults(func=cmd_serve)

    put = sub.add_parser("put", help="put the samples of a JSON-lines file into a live job (durable when it "
                                     "returns; exit 3 when a line was refused)")
    put.add_argument("target", help="host:port of a server holding the job (several: comma-separated, tried in turn)")
    put.add_argument("--job", required=True, help="the live job's id (opened by its trainers, or by --plan)")
    put.add_argument("files", nargs="+", metavar="FILE.jsonl", help="one sample a line: tokens, loss_mask, "
                     "tensors, group, policy_version, id, prompt or images (paths relative to the file)")
    put.add_argument("--end", action="store_true", help="end the job after these samples (its last step forms)")
    put.add_argument("--batch", type=int, default=256, help="samples per request")
    put.add_argument("--plan", metavar="PLAN", help="open the job with this plan when no trainer has yet: the "
                     "trainers' PlanConfig as a YAML/JSON file or inline ('{dp: 2, live: true, step_samples: 8}')")
    put.add_argument("--dataset", default="", help="with --plan: the dataset the job serves (the trainers')")
    put.add_argument("--seed", type=int, default=0, help="with --plan: the job's seed (the trainers')")
    put.add_argument("--producer-token", default=None, help="the job's producer token, when it was opened with one "
                     "(default: PACKFEED_PRODUCER_TOKEN); with --plan, the token the job is opened with")
    put.add_argument("--wait-open", type=float, default=0.0, metavar="S",
                     help="without --plan: wait up to S seconds for a trainer to open the job (default: fail at once)")
    put.set_defaults(func=cmd_put)

    health = sub.add_parser("health", help="check a server's gRPC health service (exit 0 when SERVING)")
    health.add_argument("target", nargs="?", help="host:port (default: the address in $PACKFEED_ADDRESS_FILE)")
    health.add_argument("--service", default="", help="service name (default: the whole server)")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds")
    health.add_argument("--tls-ca", help="PEM of the CA that signed the server's certificate (TLS servers)")
    health.add_argument("--tls-name", help="name to check the certificate against (default: the target host)")
    health.set_defaults(func=cmd_health)

    train = sub.add_parser("train", help="reference pipeline trainer fed by a Packfeed server (needs torch)")
    train.add_argument("--config", help="YAML/JSON trainer config (see packfeed.trainer.config)")
    train.add_argument("--nproc", type=int, default=0, help="launch under torchrun on this machine: dp x cp x pp "
                       "processes, + parallel.encoder_ranks (the mesh's size; a different count is corrected, with a note), sharing the cores "
                       "(OMP_NUM_THREADS = cores / processes unless set)")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. parallel.pp=2 data.index=INDEX")
    train.set_defaults(func=cmd_train)

    simulate = sub.add_parser("simulate", help="predict step and epoch time, bubbles and MFU of a plan on a "
                              "cluster, for each data strategy and encoder placement (no GPU needed)")
    from packfeed.cli.simulate import add_arguments

    add_arguments(simulate)
    simulate.set_defaults(func=cmd_simulate)

    warmup = sub.add_parser("warmup", help="compile and cache the planner's kernels (run where an image is built or "
                                           "a venv installed, so a fresh server plans at once)")
    warmup.set_defaults(func=cmd_warmup)

    calibrate = sub.add_parser("calibrate", help="measure what preparing images and text costs a core of this "
                                                 "machine, per pixel mode, and keep it for info, stats and serve")
    calibrate.add_argument("--pixels", nargs="+", choices=[mode.value for mode in PixelMode],
                           default=[mode.value for mode in PixelMode], help="pixel modes to measure (default all)")
    calibrate.add_argument("--rounds", type=int, default=5, help="rounds per item; the median counts (default 5)")
    calibrate.set_defaults(func=cmd_calibrate)

    demo = sub.add_parser("demo", help="build a demo dataset, index it, report and plan")
    demo.add_argument("--out", default="demo-out")
    demo.add_argument("--samples", type=int, default=240)
    demo.add_argument("--dataset-only", action="store_true", help="write and index the dataset, then stop")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as error:  # bad input or an address/file problem: a message, not a traceback
        print(f"packfeed {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE


_HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def _restart_with_huge_pages() -> None:
    """Re-exec the command once with glibc's malloc asking for transparent huge pages.

    Planning allocates multi-GB arrays (through numba and numpy); with 4 KiB pages, first-touch page faults
    took a third of the wall time at 100M samples on our VMs, and huge pages make the whole `packfeed
    plan` about 20% faster there (BENCHMARKS.md). The tunable must be in the environment when the process
    starts, hence the exec. Opt out with PACKFEED_NO_HUGE_PAGES=1; older glibc ignores the tunable.
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if (sys.platform != "linux" or "glibc.malloc.hugetlb" in tunables or os.environ.get("PACKFEED_NO_HUGE_PAGES")
            or not _transparent_huge_pages_on_request()):
        return
    os.environ["GLIBC_TUNABLES"] = f"{tunables}:{_HUGE_PAGES_TUNABLE}" if tunables else _HUGE_PAGES_TUNABLE
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "packfeed.cli", *sys.argv[1:]])


def _transparent_huge_pages_on_request() -> bool:
    """True when the kernel gives huge pages to memory that asks (mode `madvise`; `always` needs no ask)."""
    try:
        return "[madvise]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def entry() -> None:
    """The `packfeed` console command: main(), then exit without interpreter teardown.

    Every file is closed by then; skipping teardown saves the ~0.5 s numba's shutdown costs, a sixth of
    planning 1.2M samples.
    """
    _restart_with_huge_pages()
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

