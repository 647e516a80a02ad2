"""Shards in object storage (gs://, s3://, az://): URLs, settings, reads.

One library does the HTTP, authentication and retries: obstore, Rust's
object_store (chosen by measurement: BENCHMARKS.md, "Object storage
libraries"). Stores come from each cloud's standard environment and a
dataset's optional `[datasets.NAME.storage]` table; every read is pinned to
the object's recorded ETag or generation. Which module does what:
docs/design.md, "server/".
"""
