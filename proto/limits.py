"""Limits both sides of the wire agree on: a server enforces them, a client
stays within them.

MAX_REQUEST_BYTES: a request (BatchRequest, DescribeRequest, BulkRequest) is
a dataset name, a few integers, a token and, for a stream dataset, its
position; anything longer is refused before it is parsed, and before
authentication (gRPC's receive limit, the bulk transport's request frame
limit), so a call or connection whose request is still arriving holds at
most this.

MAX_STREAM_STATE_BYTES: a stream dataset's position (a Grain iterator's
state as JSON: an upstream index and a few counters, tens of bytes) must fit
a request with room to spare; a server refuses to produce a longer one.

LONG_STREAM_STEPS: a request for more steps than this is a long stream; a
worker lets long streams hold only half of its request slots
(server/serving/admission.py), so a default client asks for at most half
as many at once (client/window.py) and always finds the other half.

MAX_SKIP_STEPS: the most global batches one Skip call fast-forwards a stream
dataset by (it computes them all, sending none), whatever G.

MAX_SKIP_ROWS: the most rows (steps times G) one Skip call computes, or one
step if G is more: a worker's CPU per call is bounded by rows, not steps
(`skip_steps`). A client splits a longer skip into calls of at most
`skip_steps(G)` steps, each under its own deadline.

MAX_EXPLAIN_ROWS: the most rows one Explain answer describes (a host's
slice, a few hundred bytes of JSON a row), so that it fits a control
message (client/transport/connection.py MAX_CONTROL_MESSAGE_BYTES).

MAX_SUMMARY_ROWS: the most records one Explain summary counts (steps times
G), arithmetic in chunks on the worker that answers it.

MAX_STREAM_SHARDS: the most sub-streams a stream dataset splits into (its
config's stream_shards): a client runs a fetch loop per sub-stream, and its
cursor holds a position per sub-stream (32 of MAX_STREAM_STATE_BYTES fit a
saved state's MAX_STATE_BYTES, client/state.py, with room to spare).

MAX_STREAM_SUMMARY_ROWS: the most rows one Explain summary of a stream
dataset traces (each step is made twice, served and traced: seconds per
call, within a request's deadline); a client splits a longer range into
calls of at most this many, each going on where the last ended. Explain and
summary refuse a stream whose G is more: its one global batch would be too.
"""

MAX_REQUEST_BYTES = 64 << 10
LONG_STREAM_STEPS = 64
MAX_STREAM_STATE_BYTES = MAX_REQUEST_BYTES // 4
MAX_STREAM_SHARDS = 32
MAX_SKIP_STEPS = 1 << 16
MAX_SKIP_ROWS = 1 << 12
MAX_EXPLAIN_ROWS = 8192
MAX_SUMMARY_ROWS = 1 << 28
MAX_STREAM_SUMMARY_ROWS = 1 << 14


def stream_summary_steps(global_batch_size: int) -> int:
  """The most steps of G one Explain summary of a stream dataset traces:
  MAX_STREAM_SUMMARY_ROWS rows, or one step if G is more (which a server
  refuses to trace)."""
  return max(1, MAX_STREAM_SUMMARY_ROWS // global_batch_size)


def skip_steps(global_batch_size: int) -> int:
  """The most steps of G one Skip call moves: MAX_SKIP_ROWS rows (at most
  MAX_SKIP_STEPS steps), or one step if G is more."""
  return max(1, min(MAX_SKIP_STEPS, MAX_SKIP_ROWS // global_batch_size))
