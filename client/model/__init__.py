"""What a model makes of a step: the Hugging Face model inputs of a pack (`hf`, with the family table
`hf_families` and the config that matches a dataset, `hf_config`), attention masks (`attention`), context
parallel splits (`context_parallel`), shared prefixes computed once (`shared_prefix`), losses and per-dataset
losses (`losses`, `dataset_losses`), the vision towers every rank runs (`towers`) and the guard that keeps a
tower only the guard called unchanged (`guard_updates`). Stands on the stream room (a step's tensors)."""
