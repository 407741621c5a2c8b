"""Parallelism applied to a model's layer list, never woven into it: the (dp, pp) mesh (`mesh`), each rank's
order of operations (`schedules`), pipeline stages and schedules (`pipeline`), data parallelism within a stage (`data_parallel`), weights shared across
stages (`tied`), and OmniBal's measured decisions: the layer profile (`profile`), balanced partition search
(`partition`), adaptive recompute (`recompute`), made and saved by the trainer (`packfeed.trainer.decisions`)."""
