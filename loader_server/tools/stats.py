"""`packfeed stats`: a dataset statistics report from an index — HTML (self-contained), Markdown and JSON.

Distributions of images, vision and LLM tokens and their joint shape; invalid samples by reason; pack
fill; and an OmniBal Table 3-style comparison of random batches, length grouping, ISF and ISF+balance
at the requested DP and M, planned on the real index.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # reports are written headless
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import numpy as np  # noqa: E402

from packfeed.media.samples import reason_category  # noqa: E402
from packfeed.server.index.table import read_index  # noqa: E402
from packfeed.server.plan.caps import resolve_caps  # noqa: E402
from packfeed.server.plan.costs import SampleLoads, load_sample_loads  # noqa: E402
from packfeed.server.plan.groups import group_summary, grouped, prefix_savings  # noqa: E402
from packfeed.server.plan.trees import is_tree, one_level  # noqa: E402
from packfeed.server.plan.isf import Caps  # noqa: E402
from packfeed.server.plan.plan_file import Plan  # noqa: E402
from packfeed.server.plan.planner import make_plan  # noqa: E402
from packfeed.server.tools.info import describe  # noqa: E402
from packfeed.server.tools.stats_render import report_html, report_markdown  # noqa: E402
from packfeed.v1.options import PlanConfig, Strategy  # noqa: E402

ONE = "one-level"  # a comparison plan of trees sharing only their prompts (`one_level`)
REPORT_COLUMNS = ["valid", "reason", "n_images", "n_videos", "vision_units", "vision_tokens", "llm_tokens", "text_tokens",
                  "loss_tokens", "shard"]


def compare_strategies(loads, config: PlanConfig, seed: int, fingerprint: str,
                       caps: Caps | None = None) -> tuple[list[dict], Plan]:
    """Plan the epoch with every strategy at the same DP, M and caps; returns rows and the ISF+balance plan."""
    caps = caps or resolve_caps(loads, config)
    rows, balanced = [], None
    safe, shared = config.collective_safe, config.shared_prefix
    variants = [(strategy, safe, shared) for strategy in Strategy if strategy is not Strategy.ISF_PHASES]
    if safe:  # what laying the plans out collective-safe costs the balanced plan
        variants.insert(variants.index((Strategy.ISF_BALANCE, True, shared)) + 1, (Strategy.ISF_BALANCE, False, shared))
    if grouped(loads) and shared:  # what sharing the groups' prefixes saves the balanced plan
        variants.insert(variants.index((Strategy.ISF_BALANCE, safe, True)) + 1, (Strategy.ISF_BALANCE, safe, False))
        if is_tree(loads) and loads.prompt is not None:  # trees: against their prompts shared alone, too
            variants.insert(variants.index((Strategy.ISF_BALANCE, safe, True)) + 1, (Strategy.ISF_BALANCE, safe, ONE))
    for strategy, collective_safe, shares in variants:  # ISF_PHASES: its encoder phase has Dist figures of its own
        planned = one_level(loads) if shares is ONE else loads
        plan = make_plan(planned, replace(config, strategy=strategy, collective_safe=collective_safe,
                                          shared_prefix=bool(shares)), seed, 0, fingerprint, caps=caps)
        summary = plan.summary(planned)
        vision, llm = plan.pack_loads(planned)
        label = strategy.value + ("" if collective_safe == safe else ", not collective-safe") + \
            ("" if shares == shared else ", each sample alone" if not shares else ", one-level prefix sharing")
        rows.append({"strategy": label, "collective_safe": collective_safe, "samples_per_pack": summary["samples_per_pack"],
                     "max_pack_tokens": int(llm.max()) if len(llm) else 0, "pad_ratio": summary["pad_ratio"],
                     "vit_dist": summary["vit_dist"], "llm_dist": summary["llm_dist"], "packs": summary["packs"],
                     "steps": summary["steps"], "planning_seconds": summary["planning_seconds"],
                     "unaligned_microbatches": summary["collective_safe"]["unaligned_microbatches"],
                     "llm_tokens": int(llm.sum()), "vision_units": int(vision.sum())})
        if strategy is Strategy.ISF_BALANCE and collective_safe == safe and shares == shared:
            balanced = plan
    return rows, balanced


def groups_note(rows: list[dict], groups: dict) -> str:
    """What sharing the groups' prefixes saves ISF+balance: LLM tokens, vision units and steps (of trees: against
    one-level prefix sharing too)."""
    shared = next((r for r in rows if r["strategy"] == Strategy.ISF_BALANCE.value), None)
    alone = next((r for r in rows if r["strategy"].endswith("each sample alone")), None)
    one = next((r for r in rows if r["strategy"].endswith("one-level prefix sharing")), None)
    if shared is None or alone is None:
        return ""
    what = "trees of trajectories compute every shared turn once" if one else "groups share their prefix"
    level = f", {one['llm_tokens']:,}, {one['vision_units']:,} and {one['steps']:,} with one-level prefix sharing" \
        if one else ""
    return (f"{groups['groups']:,} {what} ({groups['split_groups']:,} over more than one pack): "
            f"ISF+balance computes {shared['llm_tokens']:,} LLM tokens and {shared['vision_units']:,} vision units in "
            f"{shared['steps']:,} steps, against {alone['llm_tokens']:,}, {alone['vision_units']:,} and "
            f"{alone['steps']:,} with each sample alone{level} (packfeed simulate gives the step time of each).")


def collective_safe_note(rows: list[dict], config: PlanConfig) -> str:
    """What the comparison's plans are laid out for, and what it costs the balanced plan."""
    if not config.collective_safe:
        return ("Plans are not laid out collective-safe (collective_safe off): the best balance, but with FSDP or "
                "ZeRO-3 wrapping the vision tower apart, a rank without an image can leave the others waiting.")
    safe = next((r for r in rows if r["strategy"] == Strategy.ISF_BALANCE.value), None)
    free = next((r for r in rows if r["strategy"].endswith("not collective-safe")), None)
    if safe is None or free is None:
        return ""
    cost = (f"LLM Dist {free['llm_dist']:.4f} without it, {safe['llm_dist']:.4f} with it; ViT Dist "
            f"{free['vit_dist']:.4f} and {safe['vit_dist']:.4f}")
    unaligned = (f"; {safe['unaligned_microbatches']} microbatch(es) the data cannot align (ensure_encoders covers "
                 "them)" if safe["unaligned_microbatches"] else "")
    return ("Plans are collective-safe (the default): in every step and microbatch, every rank's pack calls the "
            f"same vision towers or none, so FSDP / ZeRO-3 with the tower wrapped apart never waits on a rank. "
            f"What it costs ISF+balance: {cost}{unaligned}. A trainer that keeps the tower in its root unit (DDP, "
            "packfeed train) can turn it off for the best balance (--no-collective-safe, "
            "PlanConfig(collective_safe=False)).")


def _figure_png(draw) -> bytes:
    import io

    # drawn at twice the size it is shown (a 4-column grid that fits a laptop's screen), so its text stays sharp
    fig, ax = plt.subplots(figsize=(4.0, 2.5), dpi=150)
    draw(ax)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def _hist(values, title, xlabel, bins=50, integer=False):
    def draw(ax):
        if len(values):
            edges = np.arange(values.min(), values.max() + 2) - 0.5 if integer and values.max() - values.min() < 60 \
                else bins
            ax.hist(values, bins=edges, color="#3b6ea8")
        if integer:  # counts: whole-number ticks (not -0.5 ... 1.5 images)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("samples")
    return draw


def _joint(vision, tokens):
    def draw(ax):
        if len(vision):
            h = ax.hist2d(vision, tokens, bins=(min(40, max(2, len(np.unique(vision)))), 50), cmap="viridis",
                          cmin=1)
            plt.colorbar(h[3], ax=ax, label="samples")
        ax.set_title("Joint distribution")
        ax.set_xlabel("vision units per sample")
        ax.set_ylabel("LLM tokens per sample")
    return draw


def _fill(plan: Plan, loads):
    vision, llm = plan.pack_loads(loads)
    real = plan.pack_sizes() > 0

    def draw(ax):
        if plan.caps is not None and real.any():
            ax.hist(100 * vision[real] / plan.caps.vision_cap, bins=40, alpha=0.6, label="vision units")
            ax.hist(100 * llm[real] / plan.caps.token_cap, bins=40, alpha=0.6, label="LLM tokens")
            ax.legend()
        ax.set_title("Pack fill (ISF+balance), % of cap")
        ax.set_xlabel("% of cap")
        ax.set_ylabel("packs")
    return draw


def _reasons(counts: dict[str, int]):
    def draw(ax):
        if counts:
            names = list(counts)
            ax.barh(names, [counts[n] for n in names], color="#b5523b")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        else:
            ax.text(0.5, 0.5, "no invalid samples", ha="center", va="center")
        ax.set_title("Invalid samples by reason")
        ax.set_xlabel("samples")
    return draw


@dataclass
class ReportInput:
    """What a report describes: one index, or the first epoch of a mixture (rows of several indexes)."""

    label: str  # what the report is of: the index path, or "mixture NAME (path)"
    fingerprint: str
    source: str
    loads: SampleLoads  # rows; invalid ones too for an index
    n_images: np.ndarray | None  # per row, None when the index does not know (imported lengths)
    vision_tokens: np.ndarray
    reasons: Counter
    shard_errors: list
    image_policy: dict | None
    caps: Caps | None = None  # given for a mixture: searched on every sample once
    datasets: dict | None = None  # a mixture's per-dataset counts
    n_videos: np.ndarray | None = None  # per row, None when the index does not know
    schedule: list[dict] | None = None  # a moving mixture's windows: weights and draws (MixtureDraws.describe)


def index_input(index_path: str | Path) -> ReportInput:
    table, info = read_index(index_path, columns=REPORT_COLUMNS)
    loads, _ = load_sample_loads(index_path)
    n_images, n_videos = (table.column(name).to_numpy(zero_copy_only=False) for name in ("n_images", "n_videos"))
    known = bool(len(n_images)) and not np.all(np.isnan(n_images.astype(float)))
    return ReportInput(str(index_path), info.fingerprint, info.source, loads,
                       n_images.astype(np.int64) if known else None,
                       table.column("vision_tokens").to_numpy(zero_copy_only=False).astype(np.int64),
                       Counter(reason_category(r) for r in table.column("reason").to_pylist() if r is not None),
                       info.skipped_shards or [], info.image_policy, n_videos=n_videos.astype(np.int64) if known else None)


def mixture_input(mixture_path: str | Path, config: PlanConfig, seed: int) -> ReportInput:
    """Epoch 0 of a mixture, repeats and subsets applied (a moving one's: every window's draw, windows of
    `config.window` samples); invalid samples and shard errors of every dataset."""
    from packfeed.server.mixture.mixture_file import Mixture
    from packfeed.server.mixture.loads import MixtureLoads

    mixture = MixtureLoads(Mixture.load(mixture_path))
    schedule = None
    if mixture.moving:  # every window's draw, by the weights at its middle
        rows, schedule = mixture.drawn_epoch(config, seed, 0)
    else:
        rows = mixture.epoch(seed, 0)  # the strategies are compared on it below, with the caps every epoch uses
    caps = resolve_caps(mixture.once().loads, config)
    parts = [index_input(entry.index) for entry in mixture.mixture.datasets]

    def gather(column: str) -> np.ndarray | None:
        arrays = [getattr(part, column) for part in parts]
        if any(a is None for a in arrays):
            return None
        return np.concatenate([arrays[k][rows.sample_ids[rows.datasets == k]] for k in range(len(parts))])

    reasons = Counter({f"{entry.name}: {reason}": count for entry, part in zip(mixture.mixture.datasets, parts)
                       for reason, count in part.reasons.items()})
    datasets = {}
    for (entry, part), count in zip(zip(mixture.mixture.datasets, parts),
                                    rows.counts(np.arange(len(rows.datasets))).values()):
        valid = int(part.loads.valid.sum())  # a moving mixture's repeat: what its windows drew, per valid sample
        datasets[entry.name] = {"repeat": round(count / max(valid, 1), 3) if schedule else entry.repeat,
                                "valid": valid, "invalid": int((~part.loads.valid).sum()), "in_epoch_0": count}
    return ReportInput(f"mixture {mixture.mixture.name} ({mixture_path})", mixture.fingerprint, "mixture", rows.loads,
                       gather("n_images"), gather("vision_tokens"), reasons,
                       [e for part in parts for e in part.shard_errors], parts[0].image_policy, caps, datasets,
                       gather("n_videos"), schedule)


def build_report(source: str | Path | ReportInput, config: PlanConfig,
                 seed: int = 0) -> tuple[dict[str, Any], dict[str, bytes]]:
    report = source if isinstance(source, ReportInput) else index_input(source)
    loads = report.loads
    valid = loads.valid
    n_images, n_videos = report.n_images, report.n_videos
    vision_tokens = report.vision_tokens[valid]
    rows, balanced = compare_strategies(loads, config, seed, report.fingerprint, report.caps) if valid.any() \
        else ([], None)
    data: dict[str, Any] = {
        "index": report.label, "fingerprint": report.fingerprint, "source": report.source,
        "samples": int(len(valid)), "valid": int(valid.sum()), "invalid": sum(report.reasons.values()),
        "invalid_by_reason": dict(sorted(report.reasons.items())), "shard_errors": report.shard_errors,
        "image_policy": report.image_policy,
        "distributions": {
            "images_per_sample": describe(n_images[valid]) if n_images is not None else None,
            "videos_per_sample": describe(n_videos[valid]) if n_videos is not None else None,
            "vision_units": describe(loads.vision[valid]),
            "vision_tokens": describe(vision_tokens),
            "llm_tokens": describe(loads.tokens[valid]),
        },
        "plan_config": {"dp": config.dp, "microbatches": config.microbatches,
                        "pipeline_stages": config.pipeline_stages, "seed": seed},
        "caps": asdict(balanced.caps) if balanced is not None and balanced.caps else None,
        "balanced_steps": int(balanced.n_steps) if balanced is not None else None,
        "comparison": rows,
        "collective_safe_note": collective_safe_note(rows, config) if rows else "",
    }
    if report.datasets is not None:
        data["datasets"] = report.datasets
    if report.schedule is not None:
        data["schedule"] = report.schedule
    if balanced is not None and grouped(loads):
        data["groups"] = group_summary(prefix_savings(balanced.members, balanced.offsets, loads),
                                       balanced.groups is not None)
        data["groups_note"] = groups_note(rows, data["groups"])
    figures = {}
    if n_images is not None:
        figures["images_per_sample"] = _figure_png(_hist(n_images[valid], "Images per sample", "images",
                                                         integer=True))
    if n_videos is not None and n_videos[valid].any():
        figures["videos_per_sample"] = _figure_png(_hist(n_videos[valid], "Videos per sample", "videos", integer=True))
    figures["vision_units"] = _figure_png(_hist(loads.vision[valid], "Vision units per sample", "vision units",
                                                integer=True))
    figures["vision_tokens"] = _figure_png(_hist(vision_tokens, "Vision (placeholder) tokens per sample", "tokens"))
    figures["llm_tokens"] = _figure_png(_hist(loads.tokens[valid], "LLM tokens per sample", "tokens"))
    figures["joint"] = _figure_png(_joint(loads.vision[valid], loads.tokens[valid]))
    if balanced is not None:
        figures["pack_fill"] = _figure_png(_fill(balanced, loads))
    figures["invalid_by_reason"] = _figure_png(_reasons(data["invalid_by_reason"]))
    if report.schedule:
        figures["schedule"] = _figure_png(_schedule(report.schedule))
    return data, figures


def _schedule(windows: list[dict]):
    def draw(ax):
        progress = [w["progress"] for w in windows]
        for name in windows[0]["weights"]:
            ax.plot(progress, [w["weights"][name] for w in windows], marker=".", label=name)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title("Mixture weights per window")
        ax.set_xlabel("progress of the epoch")
        ax.set_ylabel("weight")
        ax.legend(fontsize="small")
    return draw


def write_report(source: str | Path | ReportInput, out_dir: str | Path, config: PlanConfig,
                 seed: int = 0, sizing: tuple[int, float] | None = None) -> dict[str, Path]:
    """The report's HTML, Markdown and JSON under `out_dir`; `sizing` (GPUs, step seconds): with the loader cores
    and memory an index needs per GPU (`loader_cores`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data, figures = build_report(source, config, seed)
    if sizing is not None:
        from packfeed.server.tools.loader_cores import loader_cores

        steps = max(1, int(data["balanced_steps"] or 1))
        data["loader_cores"] = loader_cores(source, *sizing, data["valid"] / (steps * config.dp))
    for name, png in figures.items():
        (out / f"{name}.png").write_bytes(png)
    paths = {"html": out / "report.html", "markdown": out / "report.md", "json": out / "report.json"}
    paths["html"].write_text(report_html(data, figures))
    paths["markdown"].write_text(report_markdown(data, figures))
    paths["json"].write_text(json.dumps(data, indent=2))
    return paths
