"""Packfeed's trainer (`packfeed train`): the reference VLM or a `transformers` VLM trained on the packs a
Packfeed server streams, with pipeline parallelism, balanced partition search and adaptive recompute.

It depends only on `packfeed.client` and the contract (`packfeed.v1`): the model is sized from what the
server reports of the dataset, so a trainer on another machine needs no index file. Floors, bottom up (a module
imports none above its own; tests/test_layout.py): `batch` (padded step shapes), `models` (each model as a
flat list of layers), `config` (the settings), `parallel` (parallelism applied to a layer list), `simulate` (the
pipeline simulator), then what the loop composes: `data` (the stream), `decisions` (OmniBal's measured
partition and recompute), `checkpoint`, `metrics`; `loop` (the one training loop, for every model and layout);
and `train` (`packfeed train`: the mesh, the resume, the model and its layout, then the loop).
"""
