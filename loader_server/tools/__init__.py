"""Tools a person runs beside the flow: the statistics report (`packfeed stats`) and the demo (`packfeed
demo`: a dataset, its index, report and plan, then serving it to clients and training on it)."""
