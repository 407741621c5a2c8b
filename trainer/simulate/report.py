"""What `packfeed simulate` shows: a table, the JSON line, and one step's schedule per GPU as a picture."""

from __future__ import annotations

from pathlib import Path

from packfeed.trainer.simulate.placement import StepResult
from packfeed.trainer.simulate.predict import Prediction

COLOURS = {"F": "#4c78a8", "B": "#f58518", "EF": "#54a24b", "EB": "#b279a2"}
NAMES = {"F": "LLM / pipeline forward", "B": "LLM / pipeline backward", "EF": "encoder forward",
         "EB": "encoder backward"}


def table(prediction: Prediction, title: str) -> str:
    p, layout = prediction, prediction.layout
    lines = [title,
             f"  layout: encoder {layout['encoder']}, LLM dp {layout['dp']} x pp {layout['pp']} x tp {layout['tp']}"
             f" ({layout['schedule']}, {layout['chunks']} chunk(s) per stage, {layout['partition']} partition)"
             + (f", encoder GPUs {layout['encoder_groups'] * layout['tp']}" if layout["encoder_groups"] else "")
             + f"; {p.gpus} GPUs",
             f"  step {p.step_s:.4f} s (median {p.to_json()['step_s_median']:.4f} s) x {p.steps} steps = epoch "
             f"{p.epoch_s:.1f} s for {p.samples} samples",
             f"  bubble fraction {p.bubble_fraction:.3f}; MFU " + (f"{p.mfu:.3f}" if p.mfu is not None else
                                                                    "n/a (measured seconds, no FLOPs)"),
             "  idle per role: " + ", ".join(f"{role} {value:.3f}" for role, value in p.bubble_per_stage.items())]
    if p.search:
        s = p.search
        how = "each planned for its split (encoder_ranks E)" if s.get("replanned") else "the packs regrouped"
        lines.append(f"  split searched: {s['encoder_gpus']} encoder GPUs + LLM dp {s['llm_dp']}; simulated "
                     f"{s['simulated']} of {s['candidates']} feasible splits, {how}, in {s['solve_s'] * 1e3:.0f} ms")
    lines.append(f"  simulated in {p.seconds:.2f} s")
    return "\n".join(lines)


MAX_ROWS = 24


def draw_timeline(step: StepResult, path: str | Path, title: str) -> None:
    """One bar row per GPU: each task where and when it ran (filler work drawn where it filled idle time); at
    most MAX_ROWS GPUs: replica 0's stages, then encoder GPUs, then other replicas."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if step.run is None or step.tasks is None:
        raise ValueError("the step was simulated without keep_run=True")
    def row_order(d: int) -> tuple[int, int]:  # replica 0, then the encoder GPUs, then other replicas
        name = step.device_names.get(d, "")
        return (0 if name.startswith(("stage", "replica 0 ")) else 1 if name.startswith("encoder") else 2), d

    devices = sorted(step.run.intervals, key=row_order)
    if len(devices) > MAX_ROWS:
        title += f" (first {MAX_ROWS} of {len(devices)} GPUs)"
        devices = devices[:MAX_ROWS]
    height = max(2.0, 0.45 * len(devices) + 1.2)
    figure, axis = plt.subplots(figsize=(12, height))
    for row, device in enumerate(devices):
        for start, end, i in step.run.intervals[device]:
            task = step.tasks[i]
            axis.broken_barh([(start, end - start)], (row - 0.4, 0.8), facecolors=COLOURS.get(task.label, "grey"),
                             edgecolor="white", linewidth=0.3)
    axis.axvline(step.step_s, color="black", linestyle="--", linewidth=0.8)
    axis.set_yticks(range(len(devices)), [step.device_names.get(d, f"GPU {d}") for d in devices])
    axis.invert_yaxis()
    axis.set_xlabel("seconds (dashed: step end, after the gradient reduction)")
    axis.set_title(title)
    used = sorted({step.tasks[i].label for d in devices for _, _, i in step.run.intervals[d]})
    axis.legend(handles=[Patch(color=COLOURS.get(k, "grey"), label=NAMES.get(k, k)) for k in used],
                loc="upper right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
