"""Stage 1 of the flow, `packfeed index`: WebDataset shards (or length files) -> one Parquet row per sample.

`shards` reads tar members and their byte offsets; `image_policy` turns an image size into vision units and
tokens; `chat` is the one chat-template encoder the index and the server share; `indexer` costs every
sample of every shard in parallel; `lengths` imports OmniBal/InternVL length files; `table` owns the index's
schema, metadata and fingerprint.
"""
