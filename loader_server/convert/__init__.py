"""Bringing datasets in: annotation formats and Parquet -> WebDataset shards (`packfeed convert`)."""
