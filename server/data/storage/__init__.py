"""Shards in object storage (gs://, s3://, az://): URLs, settings, reads.

One library does the HTTP, authentication and retries: obstore, Rust's
object_store (chosen by measurement: BENCHMARKS.md, "Object storage
libraries"). `settings.py` builds its stores from each cloud's standard
environment and a dataset's optional `[datasets.NAME.storage]` table;
`objects.py` lists globs, reads an object's identity and fetches byte
ranges concurrently, each pinned to the object's recorded ETag or
generation; `urls.py` tells a URL from a local path.
"""
