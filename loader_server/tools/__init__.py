"""Tools a person runs beside the flow: the statistics report (`packfeed stats`), `packfeed info`, and the demo
dataset (`demo`: photographs, WebDataset shards and a tokenizer; `packfeed demo`, which also serves and trains on
it, is the command line's)."""
