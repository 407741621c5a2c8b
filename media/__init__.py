"""What a sample is, shared by every stage that reads one (convert, index, serve) and by the client: chat templates
and tokenizers, image policies and their resize kernels, the server's pixel modes as a table (`pixel_modes`) with
the `fast` path, video frame sampling, reading shard bytes from files and object stores, and numba kernels loaded
when one first runs (`jit`). It imports nothing else of Packfeed's but the contract (`packfeed.v1`)."""
