"""`packfeed` — the command line: index, plan, stats, demo."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import sys
from pathlib import Path

from packfeed.media.image_policy import VERIFY_MODES  # light: dataclasses only
from packfeed.v1.options import Oversize, PlanConfig, Strategy

EXIT_OK, EXIT_SKIPPED, EXIT_USAGE = 0, 3, 2


def add_index_options(parser: argparse.ArgumentParser) -> None:
    from packfeed.server.index.conventions import add_convention_options

    parser.add_argument("--tokenizer", help="HF tokenizers tokenizer.json (the tokenizer the trainer uses)")
    add_convention_options(parser)
    parser.add_argument("--verify-images", choices=VERIFY_MODES, default="decode",
                        help="decode (catch corrupt image data) or header (faster)")
    parser.add_argument("--max-sample-tokens", type=int, metavar="N",
                        help="samples of more LLM tokens (text and placeholders) are invalid (default 262,144)")


def add_plan_options(parser: argparse.ArgumentParser) -> None:
    """One flag per field of the plan specification (`packfeed.v1.options.PlanConfig`): --dp, --strategy, ...
    Defaults stay in the dataclass: an omitted flag is None and the field keeps its default."""
    for spec in dataclasses.fields(PlanConfig):
        flag, default = "--" + spec.name.replace("_", "-"), _field_default(spec)
        help_text = spec.metadata["help"]
        if spec.name == "cost_model":
            parser.add_argument(flag, metavar="FILE.json", help=help_text)
            continue
        if str(spec.type) == "bool":
            parser.add_argument(flag, action="store_true", default=None, help=help_text)
            continue
        kind = {"int": int, "float": float, "int | None": int}.get(str(spec.type))
        choices = {"Strategy": [s.value for s in Strategy], "Oversize": [o.value for o in Oversize]}.get(str(spec.type))
        shown = f" (default {default})" if default is not None else ""
        parser.add_argument(flag, type=kind, choices=choices, help=help_text + shown)


def _field_default(spec: dataclasses.Field):
    return spec.default.value if isinstance(spec.default, enum.Enum) else \
        None if spec.default is dataclasses.MISSING else spec.default


def plan_config_of(args: argparse.Namespace, **overrides) -> PlanConfig:
    """The PlanConfig the plan flags give (omitted flags keep the dataclass defaults)."""
    values = {spec.name: getattr(args, spec.name) for spec in dataclasses.fields(PlanConfig)}
    values = {name: value for name, value in values.items() if value is not None}
    if "cost_model" in values:
        values["cost_model"] = json.loads(Path(values["cost_model"]).read_text())
    return PlanConfig(**{**values, **overrides})


def parse_encoders(values: list[str]) -> dict[str, bool]:
    """--encoder NAME[:padded] flags as {name: padded}."""
    encoders = {}
    for value in values:
        name, _, mode = value.partition(":")
        if mode not in ("", "padded") or name in encoders:
            raise ValueError(f"--encoder {value!r}: give NAME or NAME:padded, each name once")
        encoders[name] = mode == "padded"
    return encoders


def cmd_index(args: argparse.Namespace) -> int:
    if args.from_lengths:
        from packfeed.server.index.lengths import index_from_lengths

        info = index_from_lengths(args.from_lengths, args.out, parse_encoders(args.encoder or []))
        print(json.dumps({"index": str(args.out), "fingerprint": info.fingerprint,
                          "invalid_by_reason": info.invalid_by_reason}))
        return EXIT_SKIPPED if info.invalid_by_reason else EXIT_OK
    if not args.shards:
        print("packfeed index: give shard paths/globs/brace patterns, or --from-lengths FILE.json", file=sys.stderr)
        return EXIT_USAGE
    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.indexer import build_index

    config = IndexConfig.from_args(args)
    result = build_index(args.shards, args.out, config, workers=args.workers, progress=not args.quiet, ray=args.ray)
    print(json.dumps(result.summary()))
    return EXIT_SKIPPED if result.skipped_anything else EXIT_OK


def cmd_convert(args: argparse.Namespace) -> int:
    from packfeed.server.convert.command import print_summary, run

    summary, skipped = run(args)
    print_summary(summary)
    return EXIT_SKIPPED if skipped else EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from packfeed.server.plan.costs import load_sample_loads
    from packfeed.server.plan.planner import make_plan

    if bool(args.index) == bool(args.mixture):
        raise ValueError("give --index INDEX or --mixture MIXTURE.yaml")
    if plan_config_of(args).window:
        return _plan_windows(args)
    if args.mixture:
        from packfeed.server.plan.mixture import Mixture, MixtureLoads, make_mixture_plan

        mixture = MixtureLoads(Mixture.load(args.mixture))
        plan = make_mixture_plan(mixture, plan_config_of(args), args.seed, args.epoch)
        loads = plan.rows.loads
    else:
        loads, info = load_sample_loads(args.index)
        plan = make_plan(loads, plan_config_of(args), args.seed, args.epoch, info.fingerprint)
    if args.out:
        plan.write(args.out)
    summary = plan.summary(loads)
    summary["plan_fingerprint"] = plan.fingerprint()
    if plan.rows is not None:
        summary["datasets"] = plan.rows.counts(plan.members)
    if summary["oversize"]["count"]:
        print(f"note: {summary['oversize']['count']} samples exceed a cap (policy: {summary['oversize']['policy']})", file=sys.stderr)
    print(json.dumps(summary))
    return EXIT_OK


def _plan_windows(args: argparse.Namespace) -> int:
    """`packfeed plan --window N`: plan every window (as a server would, one after another) and summarise the
    epoch: steps, balance over all of them, the time to the first window. No plan file: a windowed plan is
    made window by window where it is served."""
    import time

    from packfeed.server.plan.mapped_loads import map_sample_loads
    from packfeed.server.plan.windows import WindowedPlan

    if args.out:
        raise ValueError("--out writes whole-epoch plans; a windowed plan (--window) is planned where it is served")
    config = plan_config_of(args)
    started = time.perf_counter()
    if args.mixture:
        from packfeed.server.plan.mixture import Mixture, MixtureLoads

        mixture = MixtureLoads(Mixture.load(args.mixture), None, mapped=True)
        plan = mixture.windowed(config, args.seed, args.epoch)
    else:
        loads, info = map_sample_loads(args.index)
        plan = WindowedPlan(loads, config, args.seed, args.epoch, config.window, info.fingerprint)
    plan.window(0)
    first_seconds = time.perf_counter() - started
    balance = plan.epoch_balance()
    print(json.dumps({"strategy": config.strategy.value, "window": config.window, "windows": plan.n_windows,
                      "samples": balance["samples"], "steps": balance["steps"],
                      "vit_dist": round(balance["vit_dist"], 6), "llm_dist": round(balance["llm_dist"], 6),
                      "caps": dataclasses.asdict(plan.caps) if plan.caps else None,
                      "first_window_seconds": round(first_seconds, 3),
                      "planning_seconds": round(time.perf_counter() - started, 3),
                      "plan_fingerprint": plan.fingerprint()}))
    plan.close()
    return EXIT_OK


def cmd_stats(args: argparse.Namespace) -> int:
    from packfeed.server.tools.stats import mixture_input, write_report

    if bool(args.index) == bool(args.mixture):
        raise ValueError("give --index INDEX or --mixture MIXTURE.yaml")
    config = plan_config_of(args)
    if config.window:
        raise ValueError("the report compares whole-epoch plans; for a windowed plan's balance run "
                         "`packfeed plan --window N`")
    source = mixture_input(args.mixture, config, args.seed) if args.mixture else args.index
    paths = write_report(source, args.out, config, seed=args.seed)
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return EXIT_OK


def cmd_info(args: argparse.Namespace) -> int:
    from packfeed.server.tools.info import describe_path, format_info

    reports = [describe_path(path) for path in args.paths]
    if args.json:
        print(json.dumps(reports if len(reports) > 1 else reports[0], indent=1))
    else:
        print("\n\n".join(format_info(report) for report in reports))
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from packfeed.server.tools.demo import run_demo

    return run_demo(Path(args.out), samples=args.samples, dataset_only=args.dataset_only)


def cmd_warmup(args: argparse.Namespace) -> int:
    from packfeed.server.plan.warmup import warm_up

    print(json.dumps({"warmup_seconds": round(warm_up(), 2)}))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from packfeed.server.serve.config import load_config
    from packfeed.server.serve.observe import setup_logging
    from packfeed.server.serve.server import serve

    setup_logging(args.log_level)
    config = load_config(args.config, index=args.index, mixture=args.mixture, tokenizer=args.tokenizer,
                         shard_root=args.shard_root,
                         dataset=args.dataset, listen=args.listen, metrics_port=args.metrics_port,
                         workers=args.workers, prefetch_steps=args.prefetch_steps,
                         memory_budget_mb=args.memory_budget_mb)
    asyncio.run(serve(config))
    return EXIT_OK


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when the server answers SERVING on the standard gRPC health service (container healthchecks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = args.target
    if not target:
        address_file = os.environ.get("PACKFEED_ADDRESS_FILE", "")
        if not address_file or not Path(address_file).is_file():
            raise ValueError("give TARGET (host:port), or set PACKFEED_ADDRESS_FILE to the file the server writes "
                             "once serving (address_file in its config)")
        target = Path(address_file).read_text().strip()
    if args.tls_ca:
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes()),
                                      options=[("grpc.ssl_target_name_override", args.tls_name)] if args.tls_name
                                      else [])
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                              timeout=args.timeout)
        except grpc.RpcError as error:
            print(f"{target}: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{target}: {status}")
    return EXIT_OK if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_train(args: argparse.Namespace) -> int:
    """The reference trainer (needs torch: `pip install packfeed[client]`). With --nproc it launches itself
    under torchrun on this machine; otherwise it expects torchrun's environment (or runs one process)."""
    forwarded = (["--config", args.config] if args.config else []) + args.overrides
    if args.nproc:
        import subprocess

        from packfeed.trainer.config import load_config

        parallel = load_config(args.config, args.overrides).parallel
        world = parallel.dp * parallel.pp  # the mesh decides how many processes train
        if world != args.nproc:
            print(f"packfeed train: parallel.dp x parallel.pp = {parallel.dp} x {parallel.pp} trains on {world} "
                  f"process(es); launching {world}, not --nproc {args.nproc}", file=sys.stderr)
        return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc-per-node={world}", "-m", "packfeed.trainer", *forwarded])
    from packfeed.trainer.train import main as train_main

    return train_main(forwarded)


def cmd_simulate(args: argparse.Namespace) -> int:
    from packfeed.trainer.simulate.command import run

    return run(args)


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
    from packfeed.server.convert.command import add_arguments  # light: argparse only until run

    add_arguments(convert)
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
    serve.add_argument("--log-level", default="INFO")
    serve.set_defaults(func=cmd_serve)

    health = sub.add_parser("health", help="check a server's gRPC health service (exit 0 when SERVING)")
    health.add_argument("target", nargs="?", help="host:port (default: the address in $PACKFEED_ADDRESS_FILE)")
    health.add_argument("--service", default="", help="service name (default: the whole server)")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds")
    health.add_argument("--tls-ca", help="PEM of the CA that signed the server's certificate (TLS servers)")
    health.add_argument("--tls-name", help="name to check the certificate against (default: the target host)")
    health.set_defaults(func=cmd_health)

    train = sub.add_parser("train", help="reference pipeline trainer fed by a Packfeed server (needs torch)")
    train.add_argument("--config", help="YAML/JSON trainer config (see packfeed.trainer.config)")
    train.add_argument("--nproc", type=int, default=0, help="launch under torchrun on this machine: dp x pp processes "
                       "(the mesh's size; a different count is corrected, with a note)")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. parallel.pp=2 data.index=INDEX")
    train.set_defaults(func=cmd_train)

    simulate = sub.add_parser("simulate", help="predict step and epoch time, bubbles and MFU of a plan on a "
                              "cluster, for each data strategy and encoder placement (no GPU needed)")
    from packfeed.trainer.simulate.command import add_arguments

    add_arguments(simulate)
    simulate.set_defaults(func=cmd_simulate)

    warmup = sub.add_parser("warmup", help="compile and cache the planner's kernels (run where an image is built or "
                                           "a venv installed, so a fresh server plans at once)")
    warmup.set_defaults(func=cmd_warmup)

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
    os.execv(sys.executable, [sys.executable, "-m", "packfeed.server.cli", *sys.argv[1:]])


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


if __name__ == "__main__":
    entry()
