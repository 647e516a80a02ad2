"""A stream dataset's summary over a range (client/stream_summary.py): asked
for in calls of at most MAX_STREAM_SUMMARY_ROWS rows, each from where the
last ended, and added up to what one call over the whole range counts.
Against an in-memory backend (fake_backend.py)."""

from __future__ import annotations

import json

import pytest

from grain_elevator.client import stream_summary
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import limits
from grain_elevator.proto.errors import InternalError
from fake_backend import FakeBackend, position, read_spec, stream_info

# Two steps a call (limits.stream_summary_steps).
G = limits.MAX_STREAM_SUMMARY_ROWS // 2


def _summarize(start: int, end: int, at: int = 0, **kwargs):
  backend = FakeBackend(stream_info(), stream_end=1 << 40)
  spec = read_spec(backend.info, G, 1, 2)  # a host's spec: the summary counts whole batches
  return backend, stream_summary.summarize(backend, spec, start, end, [position(at)], **kwargs)


@pytest.mark.parametrize("start,end,calls", [
    (0, 1, [(0, 1)]),
    (0, 2, [(0, 2)]),
    (3, 8, [(3, 2), (5, 2), (7, 1)]),
    (10, 14, [(10, 2), (12, 2)]),
])
def test_a_range_is_asked_for_in_calls_each_from_where_the_last_ended(start, end, calls):
  told = []
  backend, summary = _summarize(start, end, at=17, progress=told.append)
  asked = [(e.request.start_step, e.request.num_steps) for e in backend.explains]
  assert asked == calls
  assert told == [n for _, n in calls]
  assert backend.explains[0].request.stream_state == position(17)
  # Each call goes on from the position the one before ended at.
  at = json.loads(position(17))["at"]
  for e in backend.explains:
    assert e.request.stream_state == position(at)
    for k in range(e.request.num_steps):
      _, at = backend.global_batch(e.request.start_step + k, G, at=at)
  assert summary["next_stream_state"] == position(at)
  assert summary["steps"] == [start, end]


@pytest.mark.parametrize("start,end", [(0, 1), (3, 8), (4, 11)])
def test_the_calls_add_up_to_one_call_over_the_whole_range(start, end):
  backend, summary = _summarize(start, end, at=5)
  whole = backend.explain(pb.ExplainRequest(summary=True, request=read_spec(
      backend.info, G).request(start, end - start, stream_state=position(5), whole=True)))
  assert summary == whole


def test_every_call_counts_whole_global_batches():
  backend, _ = _summarize(0, 5)
  assert {(e.summary, e.request.shard_index, e.request.shard_count, e.request.global_batch_size)
          for e in backend.explains} == {(True, 0, 1, G)}


class _Misanswering(FakeBackend):
  """Answers each call for the steps after the ones asked."""

  def explain(self, request):
    answer = super().explain(request)
    return {**answer, "steps": [s + 1 for s in answer["steps"]]}


def test_an_answer_for_other_steps_is_an_internal_error():
  backend = _Misanswering(stream_info(), stream_end=1 << 40)
  with pytest.raises(InternalError, match=r"steps \[0, 2\) answered for \[1, 3\]"):
    stream_summary.summarize(backend, read_spec(backend.info, G), 0, 4, [position(0)])


def test_merge_adds_counts_and_takes_shares_of_the_whole():
  def part(steps, state, tokens):
    return {"steps": steps, "next_stream_state": state, "rows": 2, "padding_rows": 1,
            "tokens": sum(tokens.values()), "components": {
                name: {"tokens": t, "segments": 1, "documents": 1, "share": 0.5}
                for name, t in tokens.items()}}
  merged = stream_summary.merge([part([0, 1], "a", {"x": 1, "y": 3}),
                                 part([1, 3], "b", {"x": 4})])
  assert merged["steps"] == [0, 3] and merged["next_stream_state"] == "b"
  assert (merged["rows"], merged["padding_rows"], merged["tokens"]) == (4, 2, 8)
  assert merged["components"] == {
      "x": {"tokens": 5, "segments": 2, "documents": 2, "share": 5 / 8},
      "y": {"tokens": 3, "segments": 1, "documents": 1, "share": 3 / 8}}
