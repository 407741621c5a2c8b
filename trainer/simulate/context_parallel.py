"""Context-parallel steps for the simulator (`packfeed simulate --context-parallel C --cp-mode static|dynamic`).

A CP plan puts each pack on d aligned GPUs of its replica's C (`packfeed.server.plan.context_parallel`); the
simulate command hands its packs over as `CpWorkload` (their GPUs and load rows), and a step on the cluster is:

- a pack's d GPUs each do 1/d of every layer's work (the zigzag split balances causal attention too). Per LLM
  layer they all-gather K and V (forward) and reduce-scatter their gradients (backward), a ring over the d GPUs
  of the layer's K and V bytes per token (its K/V heads x head size x 2: under GQA a fraction of its hidden
  size; a measured cost model, which knows no heads, counts 2 x its output bytes, an upper bound). `allgather` (what
  `packfeed train parallel.cp` runs): the exchange comes before the layer's attention, adding to it; `ring`
  (ring attention, Megatron-Core's p2p): it overlaps the layer's attention kernel, and the layer takes its
  linear part plus the longer of its attention and that exchange. The image features the pack's GPUs encoded are
  all-gathered once (not overlapped). What splitting costs beyond 1/d of the FLOPs, measured on a GPU
  (`split_attention`): attention in flash-attention's tiles, and, under `allgather`, assembling the gathered K
  and V; both where the workload knows its packs' sample lengths (plans; a run's metrics give only sums);
- `megatron-llava` (static CP as Megatron-Core's LLaVA runs it, the baseline): every pack over all C GPUs, and
  each of them runs the vision tower over all of the pack's images before the embeddings are split, so the
  vision work is not shared (and no features are gathered);
- a replica's GPUs run their microbatches in order, and the d GPUs of a pack start it together (each waits for
  the slowest of them to finish its previous microbatch); a GPU with nothing in a microbatch idles;
- the step ends with the gradients reduce-scattered and the weights all-gathered over all dp x C GPUs (every GPU
  holds the whole model at pp 1), after the last GPU's backward.
Pure numpy, deterministic; the same layer costs as every other layout (`model_shape.LayerTable`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packfeed.trainer.simulate.cluster import Cluster
from packfeed.trainer.simulate.model_shape import TILES, TOKEN_SQUARE, TOKENS, VISION_SQUARE, LayerTable
from packfeed.trainer.simulate.placement import GRAD_BYTES, PARAM_BYTES
from packfeed.trainer.simulate.split_attention import GATHERED_KV_SECONDS_PER_BYTE, share_costs
from packfeed.v1.context_parallel import degree_for

SPLIT_TERMS = (TILES, VISION_SQUARE, TOKENS, TOKEN_SQUARE)  # what d GPUs share; the constant each pays


@dataclass
class CpWorkload:
    """Every pack of a CP plan: its step, replica, microbatch, degree, first lane and load row (1, tiles, sum of
    squared ViT sequences, tokens, sum of squared token spans, or what its split attention costs in tiles), and
    the K/V rows its busiest GPU gathers per layer (`split_attention.share_costs`; None when unknown)."""

    step: np.ndarray
    replica: np.ndarray
    microbatch: np.ndarray
    degree: np.ndarray
    group: np.ndarray
    loads: np.ndarray  # (packs, 5)
    steps: int
    dp: int
    microbatches: int
    groups: int  # C
    samples: int
    mode: str
    gathered_rows: np.ndarray | None = None

    @classmethod
    def of_packs(cls, step, replica, microbatch, degree, group, tokens, tiles, square, patches_per_tile: int,
                 steps: int, dp: int, microbatches: int, groups: int, samples: int, mode: str,
                 lengths: list[np.ndarray] | None = None) -> CpWorkload:
        """Packs given by their place and sizes (whole-pack tokens, tiles, sum of squared sample lengths); with
        each pack's sample `lengths`, its attention and gathered rows as a GPU runs them (`share_costs`)."""
        loads = np.zeros((len(degree), 5))
        loads[:, 0] = 1.0
        loads[:, TILES], loads[:, TOKENS], loads[:, TOKEN_SQUARE] = tiles, tokens, square
        loads[:, VISION_SQUARE] = loads[:, TILES] * float(patches_per_tile) ** 2
        ints = [np.asarray(a, dtype=np.int64) for a in (step, replica, microbatch, degree, group)]
        gathered = None
        if lengths is not None:
            costs = np.array([share_costs(pack, int(d)) for pack, d in zip(lengths, ints[3])]).reshape(-1, 2)
            loads[:, TOKEN_SQUARE] = costs[:, 0] * ints[3]  # pack_seconds shares it among the d GPUs again
            gathered = costs[:, 1]
        return cls(*ints, loads, steps, dp, microbatches, groups, samples, mode, gathered)

    @property
    def peak_tokens_per_gpu(self) -> int:
        return int(np.max(np.ceil(self.loads[:, TOKENS] / self.degree))) if len(self.degree) else 0


CP_COMM = ("allgather", "ring")
CP_MODES = ("dynamic", "static", "megatron-llava")  # megatron-llava: static packs, the vision tower unsplit


def pack_seconds(table: LayerTable, cluster: Cluster, loads: np.ndarray, degree: np.ndarray,
                 gpus: list[list[int]], comm: str = "allgather", gathered_rows: np.ndarray | None = None,
                 vision_split: bool = True) -> np.ndarray:
    """Seconds each GPU of each pack spends on it (forward and backward), communication included; under
    `allgather`, assembling `gathered_rows` K/V rows per LLM layer too. `vision_split` False: every GPU of a pack
    runs the vision tower over all its images (Megatron-Core's LLaVA), and no features are gathered."""
    seconds = table.seconds(cluster.flops_per_second)  # (layers, 2, terms)
    shared = np.zeros(loads.shape)
    shared[:, list(SPLIT_TERMS)] = loads[:, list(SPLIT_TERMS)] / degree[:, None]
    if not vision_split:
        shared[:, [TILES, VISION_SQUARE]] = loads[:, [TILES, VISION_SQUARE]]
    shared[:, 0] = loads[:, 0]
    llm = np.array([kind == "llm" for kind in table.kinds])
    attention = np.zeros(loads.shape[1], dtype=bool)
    attention[TOKEN_SQUARE] = True
    linear_part = np.einsum("lft,pt->pfl", seconds[:, :, ~attention], shared[:, ~attention])
    attention_part = np.einsum("lf,p->pfl", seconds[:, :, TOKEN_SQUARE], shared[:, TOKEN_SQUARE])
    kv_bytes = table.kv_bytes_per_token()  # K and V per token, per layer (the K/V heads, under GQA fewer)
    projector = table.kinds.index("projector") if "projector" in table.kinds else None
    out = np.zeros(len(degree))
    for p, (d, ranks) in enumerate(zip(degree.tolist(), gpus)):
        exchange = np.array([cluster.ring_seconds(kv_bytes[layer] * loads[p, TOKENS], ranks) if llm[layer] and d > 1
                             else 0.0 for layer in range(len(table))])
        if comm == "ring":
            per_layer = linear_part[p] + np.maximum(attention_part[p], exchange[None, :])
        else:
            per_layer = linear_part[p] + attention_part[p] + exchange[None, :]
        features = assembling = 0.0
        if d > 1 and projector is not None and vision_split:
            features = 2 * cluster.ring_seconds(table.output_bytes[projector, TILES] * loads[p, TILES], ranks)
        if comm == "allgather" and gathered_rows is not None:
            assembling = gathered_rows[p] * float(kv_bytes[llm].sum()) * GATHERED_KV_SECONDS_PER_BYTE
        out[p] = per_layer.sum() + features + assembling
    return out


def simulate_cp(workload: CpWorkload, table: LayerTable, cluster: Cluster, comm: str = "allgather") -> dict:
    """Step and epoch time, bubble fraction, MFU, peak tokens per GPU, the GPU-seconds of work (every GPU's busy
    time, added up) and each step's gradient and weight sync of a CP plan on `cluster`, its K/V exchanged as
    `comm` says (CP_COMM)."""
    if comm not in CP_COMM:
        raise ValueError(f"--cp-comm must be one of {', '.join(CP_COMM)}, not {comm!r}")
    c, dp = workload.groups, workload.dp
    gpus = dp * c
    if cluster.gpus != gpus:
        raise ValueError(f"context parallelism runs on dp x C = {gpus} GPUs; --gpus is {cluster.gpus}")
    ranks = [[int(r) * c + lane for lane in range(int(g) * int(d), (int(g) + 1) * int(d))]
             for r, d, g in zip(workload.replica, workload.degree, workload.group)]
    busy = pack_seconds(table, cluster, workload.loads, workload.degree, ranks, comm, workload.gathered_rows,
                        workload.mode != "megatron-llava")
    params = float(table.params.sum())
    everyone = list(range(gpus))
    sync = cluster.ring_seconds(params * GRAD_BYTES, everyone) + cluster.ring_seconds(params * PARAM_BYTES, everyone)
    order = np.lexsort((workload.microbatch, workload.step))
    step_times = np.zeros(workload.steps)
    busy_total = float((busy * workload.degree).sum())
    compute_span = 0.0
    k = 0
    for step in range(workload.steps):
        ready = np.zeros(gpus)
        while k < len(order) and workload.step[order[k]] == step:
            p = order[k]
            start = ready[ranks[p]].max()
            ready[ranks[p]] = start + busy[p]
            k += 1
        compute_span += float(ready.max())
        step_times[step] = ready.max() + sync
    epoch = float(step_times.sum())
    flops = None
    if table.forward_flops is not None:
        flops = 3.0 * float((workload.loads @ table.forward_flops.T).sum())
    return {"mode": workload.mode, "comm": comm, "context_parallel": c, "dp": dp, "gpus": gpus, "steps": workload.steps,
            "samples": workload.samples, "step_s": epoch / max(1, workload.steps), "epoch_s": epoch,
            "step_s_median": float(np.median(step_times)) if workload.steps else 0.0,
            "bubble_fraction": 1.0 - busy_total / (gpus * compute_span) if compute_span else 0.0,
            "busy_gpu_s": busy_total, "sync_s": sync,
            "mfu": flops / (gpus * cluster.peak_tflops * 1e12 * epoch) if flops is not None and epoch else None,
            "peak_tokens_per_gpu": workload.peak_tokens_per_gpu,
            "degrees": {str(int(d)): int(n) for d, n in zip(*np.unique(workload.degree, return_counts=True))}}


def epoch_bound(tokens: np.ndarray, vision: np.ndarray, table: LayerTable, cluster: Cluster, patches_per_tile: int,
                dp: int, cp: int, microbatches: int, max_tokens: int, sync_s: float) -> dict:
    """The shortest epoch any CP plan of these samples could take under the model (`bound_epoch_s`): every
    sample's work whole on one GPU (no split costs, packs of any size: its per-pack constant left out), plus what
    splitting the samples above N costs at the least (each alone at the fewest GPUs that hold it, against the
    same sample whole), spread evenly over all dp x C GPUs with no bubble, plus the gradient sync of the fewest
    steps that hold every token at N per GPU and M microbatches a step."""
    tokens, vision = np.asarray(tokens, dtype=np.int64), np.asarray(vision, dtype=np.float64)
    gpus = dp * cp

    def gpu_seconds(ids: np.ndarray, degree: np.ndarray) -> float:  # each sample of `ids` alone on its degree
        if not len(ids):
            return 0.0
        zeros = np.zeros(len(ids), dtype=np.int64)
        packs = CpWorkload.of_packs(zeros, zeros, zeros, degree, zeros, tokens[ids].astype(float), vision[ids],
                                    tokens[ids].astype(float) ** 2, patches_per_tile, 1, 1, 1, cp, len(ids), "bound",
                                    [tokens[ids][k:k + 1] for k in range(len(ids))] if (degree > 1).any() else None)
        packs.loads[:, 0] = 0.0  # a pack's constant: packs of many samples pay it once, so it is left out
        seconds = pack_seconds(table, cluster, packs.loads, packs.degree, [list(range(int(d))) for d in degree],
                               "allgather", packs.gathered_rows)
        return float((seconds * degree).sum())

    everyone = np.arange(len(tokens))
    whole = gpu_seconds(everyone, np.ones(len(tokens), dtype=np.int64))
    long = np.flatnonzero(tokens > max_tokens)
    least = np.array([min(degree_for(t, max_tokens), cp) for t in tokens[long].tolist()], dtype=np.int64)
    split = gpu_seconds(long, least) - gpu_seconds(long, np.ones(len(long), dtype=np.int64))
    steps = max(1, -(-int(tokens.sum()) // (gpus * max_tokens * microbatches)))
    bound = (whole + split) / gpus + steps * sync_s
    return {"bound_epoch_s": bound, "bound_whole_s": whole / gpus, "bound_split_s": split / gpus,
            "bound_sync_s": steps * sync_s, "bound_steps": steps}
