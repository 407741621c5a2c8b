"""The commands but `convert`: each parses nothing (the parser did), imports its stage only when run (so `packfeed
--help` stays light), prints its summary as JSON and returns its exit code."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from packfeed.cli.options import EXIT_EMPTY, EXIT_OK, EXIT_SKIPPED, EXIT_USAGE, parse_encoders, plan_config_of


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
    if not result.valid:
        print(f"packfeed index: {args.out} holds no valid sample ({result.rows} rows"
              + (f"; invalid by reason: {json.dumps(result.info.invalid_by_reason)}" if result.rows else "")
              + (f"; {len(result.info.skipped_shards)} shards could not be read" if result.info.skipped_shards else "")
              + "): nothing can be trained on it. Check the shard paths and the reasons above", file=sys.stderr)
        return EXIT_EMPTY
    return EXIT_SKIPPED if result.skipped_anything else EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from packfeed.server.plan.costs import load_sample_loads
    from packfeed.server.plan.planner import make_plan

    if bool(args.index) == bool(args.mixture):
        raise ValueError("give --index INDEX or --mixture MIXTURE.yaml")
    if plan_config_of(args).window:
        return _plan_windows(args)
    if args.mixture:
        from packfeed.server.mixture.mixture_file import Mixture
        from packfeed.server.mixture.loads import MixtureLoads, make_mixture_plan

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
    if summary["collective_safe"]["unaligned_microbatches"]:
        print(unaligned_note(summary["collective_safe"]), file=sys.stderr)
    if "context_parallel" in summary:
        from packfeed.server.plan.context_parallel import default_budget_note

        note = default_budget_note(plan.config, loads, summary["context_parallel"]["max_tokens_per_gpu"])
        if note:
            print(note, file=sys.stderr)
    print(json.dumps(summary))
    if not plan.n_packs:
        print(f"packfeed plan: the plan holds no pack ({summary['valid_samples']} valid samples, "
              f"{summary['oversize']['count']} of them over a cap): nothing can be trained on it. `packfeed info "
              "INDEX` says why samples are invalid", file=sys.stderr)
        return EXIT_EMPTY
    return EXIT_OK


def unaligned_note(alignment: dict) -> str:
    """What a plan's unaligned microbatches mean for a sharded trainer, and what to do."""
    towers = ", ".join(f"{name} {count}" for name, count in alignment["unaligned_by_tower"].items())
    return (f"note: {alignment['unaligned_microbatches']} of {alignment['microbatches']} microbatches call a tower on "
            f"some DP ranks only ({towers}); under FSDP / ZeRO-3 with a tower wrapped apart, build inputs with "
            "to_hf_inputs(..., ensure_encoders=True)" + ("" if alignment["on"] else
                                                         f"; the plan is not collective-safe: {alignment['off_because']}"))


def _plan_windows(args: argparse.Namespace) -> int:
    """`packfeed plan --window N`: plan every window (as a server would, one after another) and summarise the
    epoch: steps, balance over all of them, the time to the first window; with --out, the epoch's windows in one
    plan file (steps global, the fingerprint the windowed plan's)."""
    import time

    from packfeed.server.plan.mapped_loads import map_sample_loads
    from packfeed.server.plan.windows import WindowedPlan

    config = plan_config_of(args)
    started = time.perf_counter()
    if args.mixture:
        from packfeed.server.mixture.mixture_file import Mixture
        from packfeed.server.mixture.loads import MixtureLoads

        mixture = MixtureLoads(Mixture.load(args.mixture), None, mapped=True)
        plan = mixture.windowed(config, args.seed, args.epoch)
    else:
        loads, info = map_sample_loads(args.index)
        plan = WindowedPlan(loads, config, args.seed, args.epoch, config.window, info.fingerprint)
    plan.window(0)
    first_seconds = time.perf_counter() - started
    balance = plan.epoch_balance()
    if balance["collective_safe"]["unaligned_microbatches"]:
        print(unaligned_note(balance["collective_safe"]), file=sys.stderr)
    print(json.dumps({"strategy": config.strategy.value, "window": config.window, "windows": plan.n_windows,
                      "samples": balance["samples"], "steps": balance["steps"],
                      "vit_dist": round(balance["vit_dist"], 6), "llm_dist": round(balance["llm_dist"], 6),
                      "caps": dataclasses.asdict(plan.caps) if plan.caps else None,
                      "collective_safe": balance["collective_safe"], "first_window_seconds": round(first_seconds, 3),
                      "planning_seconds": round(time.perf_counter() - started, 3),
                      "plan_fingerprint": plan.fingerprint(), **_windowed_mixture(plan, args.out)}))
    plan.close()
    return EXIT_OK


def _windowed_mixture(plan, out: str | None) -> dict:
    """The plan file written (`out`), and a mixture's samples per dataset (a moving one's weights and draws per
    window too)."""
    if not out and plan.rows is None:
        return {}
    whole = plan.whole()
    if out:
        whole.write(out)
    if plan.rows is None:
        return {}
    summary = {"datasets": plan.rows.counts(whole.members)}
    if plan.draws is not None:
        summary["windows_drawn"] = [plan.draws.describe(w, plan.rows.names) for w in range(plan.n_windows)]
    return summary


def cmd_stats(args: argparse.Namespace) -> int:
    from packfeed.server.tools.stats import mixture_input, write_report

    if bool(args.index) == bool(args.mixture):
        raise ValueError("give --index INDEX or --mixture MIXTURE.yaml")
    config = plan_config_of(args)
    if config.window and not (args.mixture and _moving(args.mixture)):
        raise ValueError("the report compares whole-epoch plans; for a windowed plan's balance run "
                         "`packfeed plan --window N` (--window is for a mixture whose weights move: its windows' "
                         "draws)")
    if config.context_parallel > 1:
        raise ValueError("the report compares strategies without context parallelism; for a CP plan's degrees, "
                         "per-GPU Dist and peak tokens run `packfeed plan --context-parallel C`, and "
                         "`packfeed simulate --context-parallel C` for its time")
    sizing = None
    if args.gpus is not None or args.step_seconds is not None:
        if args.gpus is None or args.step_seconds is None or args.mixture:
            raise ValueError("loader sizing takes --index with both --gpus N and --step-seconds S")
        if args.dp is None:
            config = dataclasses.replace(config, dp=max(1, args.gpus // config.pipeline_stages))
        sizing = (args.gpus, args.step_seconds)
    source = mixture_input(args.mixture, config, args.seed) if args.mixture else args.index
    paths = write_report(source, args.out, dataclasses.replace(config, window=0), seed=args.seed, sizing=sizing)
    summary = {k: str(v) for k, v in paths.items()}
    if sizing:
        summary["cores_per_gpu"] = json.loads(paths["json"].read_text())["loader_cores"]["cores_per_gpu"]
    print(json.dumps(summary))
    return EXIT_OK


def _moving(mixture_path: str) -> bool:
    from packfeed.server.mixture.mixture_file import Mixture

    return Mixture.load(mixture_path).schedule is not None


def cmd_info(args: argparse.Namespace) -> int:
    from packfeed.server.tools.info import describe_path, format_info

    reports = [describe_path(path) for path in args.paths]
    if args.json:
        print(json.dumps(reports if len(reports) > 1 else reports[0], indent=1))
    else:
        print("\n\n".join(format_info(report) for report in reports))
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from packfeed.cli.demo import run_demo

    return run_demo(Path(args.out), samples=args.samples, dataset_only=args.dataset_only)


def cmd_warmup(args: argparse.Namespace) -> int:
    from packfeed.server.plan.warmup import warm_up

    print(json.dumps({"warmup_seconds": round(warm_up(), 2)}))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from packfeed.server.tools.calibrate import calibrate, calibration_path
    from packfeed.v1.options import PixelMode

    models = calibrate([PixelMode(mode) for mode in args.pixels], rounds=max(1, args.rounds))
    print(json.dumps({"calibration": str(calibration_path()), **{name: model.to_dict() for name, model in
                                                                  models.items()}}))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from packfeed.media.refused_imports import refuse

    refuse("pandas")  # pyarrow imports it when it first builds an array (the planner's warm-up), for nothing
    from packfeed.server.serve.config import load_config
    from packfeed.server.serve.observe import setup_logging
    from packfeed.server.serve.server import serve

    setup_logging(args.log_level)
    config = load_config(args.config, index=args.index, mixture=args.mixture, tokenizer=args.tokenizer,
                         shard_root=args.shard_root,
                         dataset=args.dataset, listen=args.listen, metrics_port=args.metrics_port,
                         workers=args.workers, prefetch_steps=args.prefetch_steps,
                         memory_budget_mb=args.memory_budget_mb, live_spool=args.live_spool,
                         live_spool_max_gb=args.live_spool_max_gb, live_max_samples=args.live_max_samples)
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
        from packfeed.trainer.config import load_config

        config = load_config(args.config, args.overrides)
        if config.parallel.encoder_ranks == "auto":  # searched once here, handed to every process
            resolved = resolved_encoder_ranks(config, args.nproc)
            forwarded += resolved
            config = load_config(args.config, args.overrides + resolved)
        parallel = config.parallel
        world = parallel.world  # the mesh decides how many processes train
        if world != args.nproc:
            encoders = f" + parallel.encoder_ranks {parallel.encoder_ranks}" if parallel.encoder_ranks else ""
            layout = parallel.layout
            print(f"packfeed train: parallel.dp x parallel.cp x parallel.pp = {layout.dp} x {layout.cp} x "
                  f"{layout.pp}{encoders} trains on {world} process(es); launching {world}, not --nproc "
                  f"{args.nproc}", file=sys.stderr)
        return launch(world, forwarded)
    from packfeed.trainer.train import main as train_main

    return train_main(forwarded)


def resolved_encoder_ranks(config, gpus: int) -> list[str]:
    """parallel.encoder_ranks=auto for `gpus` processes: the split `packfeed simulate` finds, as overrides."""
    from packfeed.cli.encoder_split import searched_split

    split = searched_split(config, gpus)
    trials = ", ".join(f"E {t['encoder_gpus']} + dp {t['llm_dp']}: epoch {t['epoch_s']:.3g} s"
                       for t in sorted(split["search"]["trials"], key=lambda t: t["encoder_gpus"]))
    print(f"packfeed train: parallel.encoder_ranks=auto over {gpus} processes: {split['encoder_ranks']} encoder "
          f"rank(s) + parallel.dp={split['dp']} (simulated: {trials})", file=sys.stderr)
    return [f"parallel.encoder_ranks={split['encoder_ranks']}", f"parallel.dp={split['dp']}"]


def launch(world: int, forwarded: list[str]) -> int:
    """torchrun in this process (one interpreter and torch import fewer than a `torchrun` subprocess): `world`
    processes of `python -m packfeed.trainer FORWARDED`. 1 when one of them failed (torchrun has printed which,
    and its error)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # torchrun gives each process 1 thread when OMP_NUM_THREADS is unset; share the machine's cores instead (a
    # single process would otherwise leave all but one idle)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    try:
        torchrun(["--standalone", f"--nproc-per-node={world}", "-m", "packfeed.trainer", *forwarded])
    except ChildFailedError:
        return 1
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from packfeed.cli.simulate import run

    return run(args)
