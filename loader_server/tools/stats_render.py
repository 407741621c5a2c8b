"""`packfeed stats`'s report as a reader sees it: the Markdown and the self-contained HTML page (`stats` computes
what they show). Numbers are rounded as they read; report.json keeps them raw."""

from __future__ import annotations

import base64
import html
from typing import Any


CAPTIONS = {
    "images_per_sample": "Images per sample: how many images each valid sample holds (text-only samples at 0).",
    "videos_per_sample": "Videos per sample, where the dataset has videos.",
    "vision_units": "Vision units per sample: what the packs' vision cap counts (tiles, or patches / merge).",
    "vision_tokens": "Placeholder tokens per sample: the LLM tokens the vision features take.",
    "llm_tokens": "LLM tokens per sample, placeholders and text together: what the token cap counts.",
    "joint": "Vision units against LLM tokens, one cell per range of both: where the two loads go together, "
             "balancing one balances the other.",
    "pack_fill": "How full ISF+balance packs are, as a share of each cap: near 100% on both is little padding.",
    "invalid_by_reason": "Samples left out of every plan, by reason (the index's own records).",
    "schedule": "A moving mixture's weights, window by window over the epoch (each window draws by the weights at "
                "its middle).",
}


def shown(value: float, integral: bool = True) -> str:
    """A figure as it reads: counts as whole numbers with thousands separators, other values to 3 significant
    digits (the raw float stays in report.json)."""
    if integral or float(value).is_integer():
        return f"{round(value):,}"
    return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def _distribution_rows(distributions: dict[str, Any]) -> list[tuple[str, ...]]:
    """quantity, mean, p50, p90, p99, max: every quantity here is a count, so all but the mean are whole."""
    return [(name.replace("_", " "), f"{d['mean']:,.1f}", *(shown(d[k]) for k in ("p50", "p90", "p99", "max")))
            for name, d in distributions.items() if d]


def _comparison_markdown(rows: list[dict]) -> str:
    head = "| strategy | samples/pack | max pack tokens (padded) | Pad Ratio | ViT Dist | LLM Dist | packs | steps | plan s |\n"
    head += "|---|---|---|---|---|---|---|---|---|\n"
    return head + "".join(
        f"| {r['strategy']} | {r['samples_per_pack']:.2f} | {r['max_pack_tokens']} | {r['pad_ratio']:.4f} | "
        f"{r['vit_dist']:.4f} | {r['llm_dist']:.4f} | {r['packs']} | {r['steps']} | {r['planning_seconds']:.3f} |\n"
        for r in rows)


def report_markdown(data: dict[str, Any], figures: dict[str, bytes]) -> str:
    lines = ["# Packfeed dataset report", "", f"`{data['index']}` (fingerprint `{data['fingerprint']}`, "
             f"source: {data['source']}).", "",
             f"**{data['samples']}** samples: **{data['valid']}** valid, **{data['invalid']}** invalid.", ""]
    if data["invalid_by_reason"]:
        lines += ["## Invalid samples", "", "| reason | samples |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in data["invalid_by_reason"].items()] + [""]
    if data.get("datasets"):
        lines += ["## Datasets of the mixture", "", "| dataset | repeat | valid | invalid | samples in epoch 0 |",
                  "|---|---|---|---|---|"]
        lines += [f"| {name} | {d['repeat']:g} | {d['valid']} | {d['invalid']} | {d['in_epoch_0']} |"
                  for name, d in data["datasets"].items()] + [""]
    if data.get("schedule"):
        lines += ["## Weights over the epoch", "", "| window | progress | weights | samples drawn |", "|---|---|---|---|"]
        lines += [f"| {w['window']} | {w['progress']:.3f} | {_per_dataset(w['weights'], '.3f')} | "
                  f"{_per_dataset(w['drawn'], ',')} |" for w in data["schedule"]] + [""]
    if data["shard_errors"]:
        lines += ["## Shard errors", ""] + [f"- `{e['shard']}`: {e['error']}" for e in data["shard_errors"]] + [""]
    lines += ["## Distributions (valid samples)", "", "| quantity | mean | p50 | p90 | p99 | max |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in _distribution_rows(data["distributions"])]
    cfg = data["plan_config"]
    lines += ["", f"## Balance at DP {cfg['dp']}, M {cfg['microbatches']} (OmniBal Table 3 style)", ""]
    if data["caps"]:
        c = data["caps"]
        lines.append(f"Caps: {c['vision_cap']} vision units / {c['token_cap']} tokens; targets {c['vision_target']} / "
                     f"{c['token_target']}. Random and length-group use padded batches of the target size.")
        lines.append("")
    lines.append(_comparison_markdown(data["comparison"]))
    if data["collective_safe_note"]:
        lines += [data["collective_safe_note"], ""]
    if data.get("groups_note"):
        lines += [data["groups_note"], ""]
    if data.get("loader_cores"):
        cores = data["loader_cores"]
        lines += [f"## Loader cores per GPU ({cores['gpus']} GPUs, a step every {cores['step_seconds']:g} s, "
                  f"{cores['samples_per_gpu_step']:g} samples per GPU-step)", "",
                  "| pixels | ms per sample (mean) | p99 | cores per GPU | memory per GPU (MB) |", "|---|---|---|---|---|"]
        lines += [f"| {row[0]} | {row[1]} | {row[2]} | {row[3]} | {row[4]} |" for row in _cores_rows(cores)]
        lines += ["", f"Measured on this machine ({cores['calibration']}; `packfeed calibrate`); the server's main "
                      "process (gRPC copies) runs beside these cores.", ""]
    lines += ["## Figures", ""] + [f"![{name}]({name}.png)\n\n{CAPTIONS.get(name, '')}\n" for name in figures]
    return "\n".join(lines) + "\n"


def _cores_rows(cores: dict[str, Any]) -> list[tuple]:
    return [(mode, f"{row['ms_per_sample'].get('mean', 0):.2f}", f"{row['ms_per_sample'].get('p99', 0):.2f}",
             f"{row['cores_per_gpu']:.2f}", f"{row['memory_per_gpu_mb']:.0f}") for mode, row in cores["by_pixels"].items()]


def _per_dataset(values: dict, spec: str) -> str:
    return ", ".join(f"{name} {value:{spec}}" for name, value in values.items())


def report_html(markdown_data: dict[str, Any], figures: dict[str, bytes]) -> str:
    d = markdown_data
    esc = html.escape

    def table(header, rows):
        return ("<table><tr>" + "".join(f"<th>{esc(str(h))}</th>" for h in header) + "</tr>" +
                "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in row) + "</tr>" for row in rows) +
                "</table>")

    parts = [f"<h1>Packfeed dataset report</h1><p>Index <code>{esc(d['index'])}</code> — fingerprint "
             f"<code>{esc(d['fingerprint'])}</code>, source {esc(d['source'])}.</p>",
             f"<p class=big><b>{d['samples']:,}</b> samples · <b>{d['valid']:,}</b> valid · <b>{d['invalid']:,}</b> "
             "invalid</p>"]
    if d["invalid_by_reason"]:
        parts.append("<h2>Invalid samples by reason</h2>" + table(["reason", "samples"], d["invalid_by_reason"].items()))
    if d.get("datasets"):
        parts.append("<h2>Datasets of the mixture</h2>" + table(
            ["dataset", "repeat", "valid", "invalid", "samples in epoch 0"],
            [(name, f"{v['repeat']:g}", v["valid"], v["invalid"], v["in_epoch_0"]) for name, v in d["datasets"].items()]))
    if d.get("schedule"):
        parts.append("<h2>Weights over the epoch</h2>" + table(
            ["window", "progress", "weights", "samples drawn"],
            [(w["window"], f"{w['progress']:.3f}", _per_dataset(w["weights"], ".3f"), _per_dataset(w["drawn"], ","))
             for w in d["schedule"]]))
    if d["shard_errors"]:
        parts.append("<h2>Shard errors</h2>" + table(["shard", "error", "samples read"],
                                                      [(e["shard"], e["error"], e.get("samples_read", ""))
                                                       for e in d["shard_errors"]]))
    parts.append("<h2>Distributions (valid samples)</h2>" + table(
        ["quantity", "mean", "p50", "p90", "p99", "max"], _distribution_rows(d["distributions"])))
    cfg = d["plan_config"]
    parts.append(f"<h2>Balance at DP {cfg['dp']}, M {cfg['microbatches']}</h2>")
    if d["caps"]:
        c = d["caps"]
        parts.append(f"<p>Caps {c['vision_cap']} vision units / {c['token_cap']} tokens, targets {c['vision_target']} / "
                     f"{c['token_target']}. Random and length-group use padded batches of the target size.</p>")
    parts.append(table(["strategy", "samples/pack", "max pack tokens (padded)", "Pad Ratio", "ViT Dist", "LLM Dist", "packs",
                        "steps", "plan s"],
                       [(r["strategy"], f"{r['samples_per_pack']:.2f}", r["max_pack_tokens"], f"{r['pad_ratio']:.4f}",
                         f"{r['vit_dist']:.4f}", f"{r['llm_dist']:.4f}", r["packs"], r["steps"],
                         f"{r['planning_seconds']:.3f}") for r in d["comparison"]]))
    if d["collective_safe_note"]:
        parts.append(f"<p class=note>{esc(d['collective_safe_note'])}</p>")
    if d.get("groups_note"):
        parts.append(f"<p class=note>{esc(d['groups_note'])}</p>")
    if d.get("loader_cores"):
        cores = d["loader_cores"]
        parts.append(f"<h2>Loader cores per GPU</h2><p>{cores['gpus']} GPUs, a step every {cores['step_seconds']:g} s, "
                     f"{cores['samples_per_gpu_step']:g} samples per GPU-step; measured on this machine "
                     f"(<code>{esc(cores['calibration'])}</code>)</p>" + table(
                         ["pixels", "ms per sample (mean)", "p99", "cores per GPU", "memory per GPU (MB)"],
                         _cores_rows(cores)))
    parts.append("<h2>Figures</h2><div class=figs>" + "".join(
        f'<figure data-figure="{name}"><img alt="{esc(CAPTIONS.get(name, name))}" '
        f'src="data:image/png;base64,{base64.b64encode(png).decode()}"><figcaption>{esc(CAPTIONS.get(name, name))}'
        f"</figcaption></figure>" for name, png in figures.items()) + "</div>")
    style = ("body{font-family:system-ui,sans-serif;max-width:1400px;margin:2em auto;padding:0 1em;color:#222}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 10px;text-align:right}"
             "th{background:#f3f3f3}td:first-child{text-align:left}.big{font-size:1.3em}"
             ".figs{display:grid;grid-template-columns:repeat(auto-fill,minmax(280px,1fr));gap:10px}"
             ".note{max-width:70em;color:#333}"
             "figure{margin:0;border:1px solid #eee;padding:6px}figure img{width:100%;height:auto;display:block}"
             "figcaption{font-size:.85em;color:#555;margin-top:4px}")
    return f"<!doctype html><html><head><meta charset=utf-8><title>Packfeed report</title><style>{style}</style></head>" \
           f"<body>{''.join(parts)}</body></html>\n"
