"""What a step is made of: the dataset registry, the record stream and its
host batches, mixtures, stream datasets, batch assembly and the record
sources; shards/ reads a shard, storage/ a bucket. Which module does what:
docs/design.md, "server/"."""
