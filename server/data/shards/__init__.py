"""Where a shard is read: ArrayRecord's chunk format (chunks.py, with the
hashes checked in riegeli.c), the file reader (reader.py) and each shard's
identity as it was at start-up (identity.py)."""
