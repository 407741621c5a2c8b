"""Stage 2 of the flow, `packfeed plan`: a pure function of (index loads, plan config, seed, epoch) -> packs.

`costs` reads the planner's columns and prices samples; `isf` packs them (OmniBal's ISF), `caps` searches
the pack caps, `balance` forms steps and assigns ranks (LPT), `pipeline_order` orders each rank's
microbatches for 1F1B (MMScale), `metrics` defines Pad Ratio and Dist; `context_parallel` gives packs their context-parallel degree and GPUs;
`planner` ties them together (dataset mixtures are `packfeed.server.mixture`'s) and
`plan_file` is the resulting `Plan` and its Parquet file. The plan settings themselves are part of the
contract (`packfeed.v1.options.PlanConfig`): clients send them.
"""
