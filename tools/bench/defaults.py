"""What the benchmarks run with unless told otherwise, in a module that imports nothing.

The benchmarks read these, and so do the flags of `elevator bench` and
`elevator bench-feed`, whose help shows them: every `elevator` command
builds those flags, and the benchmarks' own modules import Grain and
servers, which take seconds.
"""

from __future__ import annotations

# Records each workload of `elevator bench` writes (text: documents), in the
# order its --workloads help names them (workloads.py, text.py).
RECORDS = {"small": 200_000, "large": 4_000, "image": 2_000, "text": 20_000}
# The same workloads read from a bucket (`--storage s3`: buckets.py,
# bucket_text.py; text: documents): more than one run reads (a run is a
# part of a first epoch, as in training, not laps of a tiny set), in shards
# of ~64 MB where the dataset allows (small: 10 of 63 MB; image: 7 of
# ~65 MB; text: 4 of ~17 MB); written once (image: ~1 min of JPEG encoding),
# then reused.
BUCKET_RECORDS = {"small": 200_000, "image": 4_000, "text": 100_000}
# The stand-in store's time to first byte (tools/testing/object_store.py):
# log-normal by its median and 99th percentile, ms (`--storage-ttfb-ms`).
BUCKET_TTFB_MS = (25.0, 150.0)
# The device check's records of the large workload (device_feed.py): 150 MB
# of shards, written in seconds.
DEVICE_RECORDS = 1_000
# The device check's training step (device_feed.py).
DEVICE_STEP_MS = 10.0
# Server worker processes of `elevator bench-feed` (its --device check:
# device_feed.default_workers()).
FEED_WORKERS = 2
