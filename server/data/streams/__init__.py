"""Stream datasets: a pipeline that is not 1:1, served from a position as
Grain's own single process gives it (stream.py), and what only streams
use: the head every worker of a replica computes (parallel_head.py), its
reads from a bucket planned a block ahead (head_reads.py), what a live
iterator holds (object_bytes.py), and production that stops when its
request does (cancellation.py). Which module does what: docs/design.md,
"server/"."""
