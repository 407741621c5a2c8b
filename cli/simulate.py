"""`packfeed simulate`: predict a plan's step and epoch time, bubbles and MFU on a cluster, for a data strategy
and an encoder placement. Reads length files, an index or a plan file; needs no GPU and no torch. The command
runs the planner on the samples (as `packfeed plan` would) and hands the packs it makes to the simulator
(`packfeed.trainer.simulate`, which knows nothing of the planner)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import numpy as np

from packfeed.trainer.simulate.cluster import Cluster
from packfeed.trainer.simulate.model_shape import PRESETS, TILES, TOKENS, load_model
from packfeed.trainer.simulate.partition import PARTITIONS
from packfeed.trainer.simulate.placement import ENCODERS, Placement, simulate_step
from packfeed.trainer.simulate.predict import Prediction, Settings, microbatches_for, pipeline_costs, simulate_plan
from packfeed.trainer.simulate.report import draw_timeline, table
from packfeed.trainer.parallel.schedules import SCHEDULES
from packfeed.trainer.simulate.workload import STRATEGIES, Workload, planner_cost_model
from packfeed.trainer.simulate.context_parallel import CP_MODES
from packfeed.v1.options import PlanConfig

from packfeed.cli.simulate_data import PLANNER_STRATEGY, cp_workload, make_workload, samples_of, workload_of_plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("data (one of)")
    source.add_argument("--lengths", nargs="+", metavar="FILE.json", help="OmniBal/InternVL length files")
    source.add_argument("--index", help="a Packfeed index")
    source.add_argument("--plan", help="a plan file (`packfeed plan --out`), with the --index or --lengths it was "
                                       "planned from; its dp, microbatches and strategy are used")
    source.add_argument("--run", metavar="OUT", help="check the simulator against a `packfeed train` run: predict "
                        "each step it measured from its own costs, partition and microbatches")
    model = parser.add_argument_group("model")
    model.add_argument("--model", default="internvl-chat-1.5", help=f"a preset ({', '.join(PRESETS)}), a JSON "
                       "shape description, or a trainer's OUT/cost_model.json (default internvl-chat-1.5)")
    plan = parser.add_argument_group("plan and parallelism")
    plan.add_argument("--strategy", default="isf+balance", choices=STRATEGIES)
    plan.add_argument("--encoder", default="stages", choices=ENCODERS, help="where the vision encoder runs")
    plan.add_argument("--dp", type=int, default=8, help="data-parallel replicas the plan feeds (default 8)")
    plan.add_argument("--pp", type=int, default=None, help="pipeline stages (default 4; 1 with --context-parallel)")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per stage (default 1)")
    plan.add_argument("--microbatches", type=int, default=8, help="packs per replica per step, M (default 8)")
    plan.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    plan.add_argument("--virtual-stages", type=int, default=1, help="chunks per stage (interleaved_1f1b)")
    plan.add_argument("--partition", default="balanced", choices=PARTITIONS, help="how layers become stages")
    plan.add_argument("--data-parallel", default="ddp", choices=("ddp", "fsdp", "zero3"),
                      help="data parallelism: ddp (one gradient reduction a step, overlapped), or sharded, fsdp / "
                           "zero3 (every layer's parameters gathered and gradients reduce-scattered over the DP "
                           "group: a barrier per layer; at --pp 1)")
    plan.add_argument("--encoder-gpus", type=int, default=0,
                      help="disaggregated: encoder GPUs (default 0: searched)")
    plan.add_argument("--samples-per-pack", type=float, default=4.0,
                      help="packs' average size / the padded baseline's batch (default 4)")
    plan.add_argument("--context-parallel", type=int, default=1, metavar="C",
                      help="GPUs per DP replica for context parallelism (a power of 2; at pp 1): each pack over the "
                           "1, 2, ..., C of them its plan gives it (docs/planning.md)")
    plan.add_argument("--cp-mode", choices=CP_MODES, default=None,
                      help="with --context-parallel: simulate this mode only (default: all three; megatron-llava: "
                           "static packs with the vision tower over all of a pack's images on every GPU, as "
                           "Megatron-Core's LLaVA runs it)")
    plan.add_argument("--cp-comm", choices=("allgather", "ring"), default="allgather",
                      help="with --context-parallel: K/V all-gathered before attention (allgather, what packfeed "
                           "train runs) or passed around a ring overlapping it (ring attention)")
    plan.add_argument("--max-tokens-per-gpu", type=int, default=None, metavar="N",
                      help="with --context-parallel: tokens one GPU may hold of a microbatch (default: the token cap)")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--epoch", type=int, default=0)
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--gpus", type=int, default=0, help="GPUs (default dp x pp x tp)")
    defaults = Cluster(1)
    cluster.add_argument("--gpus-per-node", type=int, default=defaults.gpus_per_node)
    cluster.add_argument("--peak-tflops", type=float, default=defaults.peak_tflops, help="per GPU, dense bf16")
    cluster.add_argument("--achievable", type=float, default=defaults.achievable,
                         help="fraction of peak a layer's kernels reach")
    cluster.add_argument("--intra-gbs", type=float, default=defaults.intra_gbs, help="GB/s per GPU within a node")
    cluster.add_argument("--inter-gbs", type=float, default=defaults.inter_gbs, help="GB/s per GPU across nodes")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON line (the table goes to stderr)")
    out.add_argument("--timeline", metavar="FILE.png", help="draw the median step's schedule per GPU")

def _workload(args, table, shape, samples, plan_file) -> Workload:
    patches = shape.patches_per_tile if shape else 1
    if plan_file is not None:
        args.dp, args.microbatches = plan_file.config.dp, plan_file.config.microbatches
        return workload_of_plan(plan_file, samples, patches)
    return make_workload(samples, args.strategy, args.dp, args.microbatches, args.pp, patches,
                         planner_cost_model(table, patches), args.seed, args.epoch, args.samples_per_pack)


def _cp_plans(args: argparse.Namespace, plan_file, samples, cost_model) -> list[tuple[str, object]]:
    """(mode, plan) for each CP mode simulated: the plan file's own, or each mode (or --cp-mode) planned here."""
    if plan_file is not None:
        config = plan_file.config
        if args.context_parallel not in (1, config.context_parallel) or args.max_tokens_per_gpu:
            raise ValueError(f"the plan file was planned at --context-parallel {config.context_parallel} with its "
                             "own token budget: leave --context-parallel and --max-tokens-per-gpu out")
        planned_mode = config.cp_mode.value
        mode = args.cp_mode or planned_mode
        if mode != planned_mode and not (mode == "megatron-llava" and planned_mode == "static"):
            raise ValueError(f"the plan file is a {planned_mode} CP plan: --cp-mode {mode} does not simulate it")
        args.dp, args.microbatches, args.context_parallel = config.dp, config.microbatches, config.context_parallel
        args.strategy = config.strategy.value
        return [(mode, plan_file)]
    if args.strategy not in ("isf+balance", "isf"):  # "random" would be planned as ISF packs, mislabelled
        raise ValueError(f"--context-parallel plans ISF packs: --strategy isf+balance (default) or isf, not "
                         f"{args.strategy}")
    from packfeed.server.plan.planner import make_plan

    planned = []
    for mode in [args.cp_mode] if args.cp_mode else list(CP_MODES):
        config = PlanConfig(dp=args.dp, microbatches=args.microbatches, strategy=PLANNER_STRATEGY[args.strategy],
                            samples_per_pack=args.samples_per_pack, cost_model=cost_model,
                            context_parallel=args.context_parallel, max_tokens_per_gpu=args.max_tokens_per_gpu,
                            cp_mode="static" if mode == "megatron-llava" else mode)
        planned.append((mode, make_plan(samples, config, args.seed, args.epoch)))
    return planned


def replanner(args: argparse.Namespace, table_, shape, samples):
    """`--encoder disaggregated` on lengths or an index with an ISF strategy: each split searched is planned
    for itself (`encoder_ranks`, as `packfeed plan --encoder-ranks` plans it). None otherwise: a plan file is
    simulated as planned, and the random strategies' packs are regrouped."""
    if args.encoder != "disaggregated" or args.plan or args.strategy in ("random", "random-padded"):
        return None
    patches = shape.patches_per_tile if shape else 1
    cost_model = planner_cost_model(table_, patches)

    def replan(replicas: int, encoder_ranks: int) -> Workload:  # the step's packs shared by the replicas
        return make_workload(samples, args.strategy, replicas, microbatches_for(args.dp * args.microbatches, replicas),
                             args.pp, patches, cost_model, args.seed, args.epoch, args.samples_per_pack, encoder_ranks)
    return replan


def run(args: argparse.Namespace) -> int:
    if args.run:
        return check_run(args)
    from packfeed.server.plan.plan_file import read_plan  # numba: not at the CLI's import

    plan_file = read_plan(args.plan) if args.plan else None  # read once: the CP and the pipeline paths use it
    if args.context_parallel > 1 or (plan_file is not None and plan_file.config.context_parallel > 1):
        return run_context_parallel(args, plan_file)
    if args.cp_mode or args.max_tokens_per_gpu:
        raise ValueError("--cp-mode and --max-tokens-per-gpu apply with --context-parallel C > 1")
    args.pp = 4 if args.pp is None else args.pp
    table_, shape = load_model(args.model)
    samples = samples_of(args)  # read once: the plan, the replanner and the groups' comparison plan them
    workload = _workload(args, table_, shape, samples, plan_file)
    gpus = args.gpus or args.dp * args.pp * args.tp
    cluster = Cluster(gpus, args.gpus_per_node, args.peak_tflops, args.achievable, args.intra_gbs, args.inter_gbs)
    settings = Settings(args.encoder, args.pp, args.tp, args.schedule, args.virtual_stages, args.partition,
                        args.encoder_gpus, data_parallel=args.data_parallel)
    prediction = simulate_plan(workload, table_, cluster, settings, replanner(args, table_, shape, samples))
    title = (f"packfeed simulate: {table_.name}, {workload.strategy}, encoder {args.encoder}, "
             f"{cluster.gpus} GPUs, data parallel {args.data_parallel}")
    if args.timeline:
        step = median_step(prediction, workload, table_, cluster, settings)
        draw_timeline(step, args.timeline, f"{title}: one step ({step.step_s:.3f} s)")
    record = {"model": table_.name, "strategy": workload.strategy, "encoder": args.encoder,
              "data_parallel": args.data_parallel, **prediction.to_json()}
    if workload.groups is not None:
        record["groups"] = group_comparison(args, table_, shape, cluster, settings, workload, prediction, samples)
        title += "\n" + groups_line(record["groups"])
    if args.json:
        print(table(prediction, title), file=sys.stderr)
        print(json.dumps(record))
    else:
        print(table(prediction, title))
    return 0


def group_comparison(args, table_, shape, cluster: Cluster, settings: Settings, workload: Workload,
                     prediction: Prediction, samples) -> dict:
    """A plan sharing its groups' prefixes against the same samples planned each alone (`shared_prefix` false):
    LLM tokens, vision units, steps, step and epoch time of both (a plan file: its own figures only)."""
    out = dict(workload.groups)

    def totals(w: Workload, p: Prediction, label: str) -> dict:
        return {f"llm_tokens_{label}": int(w.useful[..., TOKENS].sum()),
                f"vision_units_{label}": int(w.useful[..., TILES].sum()), f"steps_{label}": p.steps,
                f"step_s_{label}": round(p.step_s, 6), f"epoch_s_{label}": round(p.epoch_s, 3)}

    out.update(totals(workload, prediction, "shared"))
    if args.plan:
        return out
    patches = shape.patches_per_tile if shape else 1
    alone = make_workload(samples, args.strategy, args.dp, args.microbatches, args.pp, patches,
                          planner_cost_model(table_, patches), args.seed, args.epoch, args.samples_per_pack,
                          shared_prefix=False)
    unshared = simulate_plan(alone, table_, cluster, settings, None)
    out.update(totals(alone, unshared, "unshared"))
    out["epoch_speedup"] = round(unshared.epoch_s / prediction.epoch_s, 4) if prediction.epoch_s else None
    from packfeed.server.plan.trees import is_tree, one_level

    if is_tree(samples) and samples.prompt is not None:  # trees: against one-level prefix sharing, too
        level = make_workload(one_level(samples), args.strategy, args.dp, args.microbatches, args.pp, patches,
                              planner_cost_model(table_, patches), args.seed, args.epoch, args.samples_per_pack)
        out.update(totals(level, simulate_plan(level, table_, cluster, settings, None), "one_level"))
    return out


def groups_line(groups: dict) -> str:
    line = (f"groups: {groups['groups']} ({groups['split_groups']} over more than one pack); sharing their prefixes "
            f"saves {groups['prefix_tokens_saved']:,} LLM tokens and {groups['vision_units_saved']:,} vision units")
    if "epoch_s_unshared" in groups:
        line += (f"; epoch {groups['epoch_s_shared']:.1f} s shared vs {groups['epoch_s_unshared']:.1f} s each sample "
                 f"alone ({groups['epoch_speedup']:.2f}x)")
    if "epoch_s_one_level" in groups:
        line += f", {groups['epoch_s_one_level']:.1f} s with one-level prefix sharing"
    return line


def run_context_parallel(args: argparse.Namespace, plan_file=None) -> int:
    """`--context-parallel C`: the CP plan of each mode (dynamic, static, or the one --cp-mode names) on dp x C
    GPUs at pp 1: step, epoch, bubbles, MFU and the most tokens any GPU holds. A CP plan file (`--plan`) is
    simulated as planned: its mode, dp, microbatches and C."""
    from packfeed.trainer.simulate.context_parallel import simulate_cp

    if args.pp not in (None, 1) or args.encoder != "stages":
        raise ValueError("--context-parallel simulates CP plans at pp 1 with the encoder on each pack's GPUs: leave "
                         "--pp and --encoder out")
    table_, shape = load_model(args.model)
    samples = samples_of(args)
    patches = shape.patches_per_tile if shape else 1
    planned = _cp_plans(args, plan_file, samples, planner_cost_model(table_, patches))
    cluster = Cluster(args.gpus or args.dp * args.context_parallel, args.gpus_per_node, args.peak_tflops,
                      args.achievable, args.intra_gbs, args.inter_gbs)
    records = []
    for mode, plan in planned:
        workload = replace(cp_workload(plan, samples.vision, samples.tokens, patches), mode=mode)
        result = simulate_cp(workload, table_, cluster, args.cp_comm)
        records.append({"model": table_.name, "strategy": args.strategy, "planning_s": round(plan.seconds, 3),
                        "max_tokens_per_gpu": plan.summary(samples)["context_parallel"]["max_tokens_per_gpu"],
                        "oversize": int(len(plan.oversize)), **result})
    config = planned[0][1].config
    from packfeed.server.plan.context_parallel import default_budget_note  # numba: not at the CLI's import
    from packfeed.trainer.simulate.context_parallel import epoch_bound

    valid = samples.valid
    bound = epoch_bound(samples.tokens[valid], samples.vision[valid], table_, cluster, patches, args.dp,
                        args.context_parallel, args.microbatches, records[0]["max_tokens_per_gpu"],
                        records[0]["sync_s"])
    for r in records:
        r.update(bound, above_bound=r["epoch_s"] / bound["bound_epoch_s"] - 1 if bound["bound_epoch_s"] else 0.0)
    note = default_budget_note(config, samples, records[0]["max_tokens_per_gpu"])
    if note:
        print(note, file=sys.stderr)
    lines = [f"packfeed simulate: {table_.name}, {args.strategy}, DP {args.dp} x CP {args.context_parallel} = "
             f"{cluster.gpus} GPUs, M {args.microbatches}, N {records[0]['max_tokens_per_gpu']} tokens per GPU, "
             f"K/V {args.cp_comm}"]
    for r in records:
        mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "n/a"
        lines.append(f"  {r['mode']:>7}: step {r['step_s']:.4f} s x {r['steps']} steps = epoch {r['epoch_s']:.1f} s; "
                     f"bubbles {r['bubble_fraction']:.3f}; MFU {mfu}; peak {r['peak_tokens_per_gpu']} tokens per "
                     f"GPU; degrees {r['degrees']}; {r['oversize']} oversize; planned in {r['planning_s']:.2f} s; "
                     f"{r['above_bound']:.1%} above the bound")
    lines.append(f"  bound: no CP plan beats {bound['bound_epoch_s']:.1f} s an epoch ({bound['bound_whole_s']:.1f} s "
                 f"of unsplit work and {bound['bound_split_s']:.1f} s of unavoidable splitting per GPU with no "
                 f"bubble, {bound['bound_sync_s']:.1f} s of sync over at least {bound['bound_steps']} steps)")
    by_mode = {r["mode"]: r["epoch_s"] for r in records}
    if by_mode.get("dynamic"):
        lines += [f"  dynamic vs {mode}: {by_mode[mode] / by_mode['dynamic']:.2f}x per epoch" for mode in by_mode
                  if mode != "dynamic"]
    print("\n".join(lines), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"context_parallel": records}))
    return 0


def check_run(args: argparse.Namespace) -> int:
    from packfeed.trainer.simulate.measured import compare_run

    model = args.model if args.model != "internvl-chat-1.5" else None  # the default preset: the run's own costs
    result = compare_run(args.run, model)
    lines = [f"packfeed simulate --run {args.run}: encoder {result['encoder']}, pp {result['pp']}, "
             f"{result['schedule']}, partition {result['bounds']}, ranks sharing "
             + (f"{result['cores']:g} cores" if result["cores"] else "nothing"),
             "  overhead factor from the search's timed steps: " + (f"{result['overhead_factor']:.3f}" if result['overhead_factor'] else "none timed"),
             "  epoch step  simulated ms  predicted ms  measured ms   error"]
    lines += [f"  {s['epoch']:>5} {s['step']:>4} {s['simulated_s'] * 1e3:>13.1f} {s['predicted_s'] * 1e3:>13.1f} "
              f"{s['measured_s'] * 1e3:>12.1f} {s['predicted_s'] / s['measured_s'] - 1:>+7.1%}"
              for s in result["steps"]]
    lines.append(f"  {len(result['steps'])} steps: mean error {result['mean_error']:+.1%}, mean absolute error "
                 f"{result['mean_abs_error']:.1%} (raw simulation: {result['mean_error_raw']:+.1%}, "
                 f"{result['mean_abs_error_raw']:.1%})")
    print("\n".join(lines), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0


def median_step(prediction: Prediction, workload: Workload, table_, cluster: Cluster, settings: Settings):
    """The step whose time is the median, simulated again with its schedule kept (replica 0, or the whole job
    when the encoder has GPUs of its own)."""
    layout = Placement(**{k: prediction.layout[k] for k in ("encoder", "dp", "pp", "tp", "chunks", "schedule",
                                                          "encoder_groups")})
    workload = prediction.workload or workload
    if layout.dp != workload.loads.shape[1]:
        workload = workload.regrouped(layout.dp)
    order = np.argsort(prediction.step_times, kind="stable")
    k = int(order[len(order) // 2])
    costs, _ = pipeline_costs(table_, cluster, layout, workload, settings.partition)
    split = workload.encoder_split[k] if workload.encoder_split is not None else None
    return simulate_step(costs, layout, workload.loads[k], cluster, keep_run=True, encoder_split=split)
