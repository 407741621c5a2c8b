"""Packfeed's loader side (`packfeed.server`, torch-free), one sub-package per stage of the data flow:
`index` (shards -> index), `plan` (index -> balanced packs), `serve` (packs -> gRPC streams), `cluster`
(several servers sharing jobs), plus `tools` (statistics report, demo) and `cli` (the `packfeed` command).
The contract it shares with trainers lives in `packfeed.v1`."""

__version__ = "0.1.0"
