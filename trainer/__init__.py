"""Packfeed's reference trainer (`packfeed train`): a small vision-language model trained with pipeline
parallelism on the packs a Packfeed server streams, with balanced partition search and adaptive recompute.

It depends only on `packfeed.client` and the contract (`packfeed.v1`): the model is sized from what the
server reports of the dataset, so a trainer on another machine needs no index file. `config` holds the
settings, `data` the stream and the model's sizes, `model` the layers, `batch` turns a step's packs into
fixed-shape microbatches, `pipeline` the mesh, stages and schedule, `profile`/`partition`/`recompute` the
OmniBal measurements and choices that `decisions` makes and saves, `simulate` the pipeline simulator,
`checkpoint` saving and resuming, and `train` the loop that ties them together.
"""
