"""Where a shard is read: ArrayRecord's chunk format (hashes checked in C),
the file and object readers, and each shard's identity as it was at
start-up. Which module does what: docs/design.md, "server/"."""
