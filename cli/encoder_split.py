"""`parallel.encoder_ranks=auto`: how many of a run's G processes the encoder gets (DistTrain's allocation
problem), answered by `packfeed simulate`'s search on the run's own data, model and plan settings.

Every split E + D x P = G (P = parallel.pp: each LLM replica a pipeline of P GPUs) is planned for itself, as the run would plan it
(`encoder_ranks` E, dp D, the run's microbatches per LLM rank, strategy and seed), and simulated on a cluster of G
GPUs; the split with the shortest epoch wins (`packfeed.trainer.simulate.predict.search_allocation`). The model's
costs are the run's measured cost model when `data.cost_model` holds per-layer seconds (an earlier run's
OUT/cost_model.json), else its FLOPs from the reference model's shape. A pure function of the config and the
index: `packfeed train --nproc G` finds it once, before launching, and hands every process its answer.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

from packfeed.trainer.simulate.cluster import Cluster
from packfeed.trainer.simulate.model_shape import LayerTable, ModelShape, Transformer, measured_table
from packfeed.trainer.simulate.predict import Settings, search_allocation
from packfeed.trainer.simulate.workload import Workload, encoder_split_of, workload_of


def reference_shape(model) -> ModelShape:
    """The reference VLM's shape (`packfeed.trainer.models.reference.VLMConfig`, its flavor's sizes filled in)."""
    patches = (model.tile_size // model.patch_size) ** 2
    shuffle = max(1, round((patches / model.tokens_per_tile) ** 0.5))
    vision = Transformer(hidden=model.vit_dim, layers=model.vit_layers, heads=model.vit_heads,
                         ffn=int(model.vit_dim * model.mlp_ratio), causal=False)
    llm = Transformer(hidden=model.llm_dim, layers=model.llm_layers, heads=model.llm_heads, ffn=model.llm_ffn,
                      gated=True, vocab=model.vocab_size)
    projector = model.vit_dim * shuffle ** 2 * model.llm_dim + model.llm_dim ** 2
    return ModelShape("reference", vision, llm, patches, model.tokens_per_tile, projector)


def model_table(config) -> tuple[LayerTable, int]:
    """The run's layer costs and ViT patches per tile."""
    shape = reference_shape(config.model)
    if config.data.cost_model:
        record = json.loads(Path(config.data.cost_model).read_text())
        if isinstance(record, dict) and record.get("layers"):
            return measured_table(config.data.cost_model, record), shape.patches_per_tile
    return shape.layer_table(), shape.patches_per_tile


def searched_split(config, gpus: int) -> dict:
    """{"encoder_ranks": E, "dp": D, "search": the search's record} for a run of `gpus` processes."""
    from packfeed.server.plan.costs import load_sample_loads
    from packfeed.server.plan.planner import make_plan

    if not config.data.index:
        raise ValueError("parallel.encoder_ranks=auto plans on the dataset's lengths: give data.index (the "
                         "index the run trains on), or set parallel.encoder_ranks to a number")
    if gpus < 2:
        raise ValueError(f"parallel.encoder_ranks=auto splits the run's processes between the encoder and the LLM: "
                         f"give at least 2 (--nproc), not {gpus}")
    samples = load_sample_loads(config.data.index)[0]
    table, patches = model_table(config)
    d, pp = config.data, config.parallel.pp
    splits = [(e, (gpus - e) // pp) for e in range(1, gpus) if (gpus - e) % pp == 0]
    if not splits:
        raise ValueError(f"parallel.encoder_ranks=auto over {gpus} processes at parallel.pp={pp}: no split leaves "
                         f"the LLM whole pipelines of {pp} ranks beside at least one encoder rank; give --nproc "
                         f"E + dp x {pp}")

    @functools.cache
    def plan_for(replicas: int, encoder_ranks: int) -> Workload:
        """The split's plan, as the run opens it (its microbatches per LLM rank, strategy, caps and seed)."""
        plan_config = d.plan_config(dp=replicas, pipeline_stages=pp, encoder_ranks=encoder_ranks)
        plan = make_plan(samples, plan_config, d.seed, 0)
        workload = workload_of(plan.offsets, plan.members, samples.vision, samples.tokens, plan_config, patches,
                               plan_config.strategy.value)
        return replace(workload, encoder_split=encoder_split_of(
            plan.offsets, plan.members, plan.encoder_rank, samples.vision, replicas, d.microbatches, encoder_ranks))

    settings = Settings("disaggregated", pp=pp, schedule=config.parallel.schedule)
    search, _ = search_allocation(plan_for(splits[0][1], splits[0][0]), table, Cluster(gpus), settings, plan_for,
                                  splits=splits)
    return {"encoder_ranks": search["encoder_gpus"], "dp": search["llm_dp"], "search": search}
