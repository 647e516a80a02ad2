"""What a step is made of: the dataset registry, the record stream and its
host batches, mixtures, batch assembly and the record sources; streams/
serves stream datasets, shards/ reads a shard, storage/ a bucket. Which
module does what: docs/design.md, "server/"."""
