"""What a step is made of: the dataset registry (config.py), the record
stream and its host batches (dataset.py, with Grain's shuffle in shuffle.py
and Grain's private calls in grain_private.py), mixtures (mixture.py), batch
assembly (collate.py), the record sources (record_source.py, tfds_source.py),
and shards/, where a shard is read."""
