"""Packfeed's trainer (`packfeed train`): the reference VLM or a `transformers` VLM trained on the packs a
Packfeed server streams, with pipeline parallelism, balanced partition search and adaptive recompute.

It depends only on `packfeed.client` and the contract (`packfeed.v1`): the model is sized from what the
server reports of the dataset, so a trainer on another machine needs no index file. Rooms: `config` (the
settings), `data` and `batch` (the stream and its padded steps), `models` (each model as a flat list of layers),
`parallel` (the mesh, pipeline stages and schedules, and OmniBal's measured decisions), `simulate` (the
pipeline simulator), `checkpoint`, `metrics`, and `train` (the loop that ties them together); `hf_train` trains
a `transformers` model data-parallel with FSDP2 at pp=1.
"""
