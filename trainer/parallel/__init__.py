"""Parallelism applied to a model's layer list, never woven into it. What the loop drives is a step runner
(`runner`): this rank's stages of a layer list cut into a pipeline (`stages`: its stage modules, schedules
and trials), with the encoder in the bubbles (`bubbles`) or routed between ranks (`phases`); or a whole model
FSDP2-sharded over the data-parallel ranks (`whole`); or the reference model with each pack split over the GPUs
its context-parallel plan gives it (`context_parallel`; a Qwen2-VL's layers: `context_parallel_hf`). Below them: the (dp, cp, pp) mesh (`mesh`), each rank's order
of operations (`schedules`), pipeline stages and schedules (`pipeline`), data parallelism within a stage
(`data_parallel`), weights shared across stages (`tied`), and what OmniBal's measured decisions are made of:
the layer profile (`profile`), balanced partition search (`partition`), adaptive recompute (`recompute`),
made and saved by the trainer (`packfeed.trainer.decisions`)."""
