"""Admission's rules, on the class itself: the limit, who yields to a
newcomer, the write timeout, and one log line for many cancellations."""

from __future__ import annotations

import logging
import time

import pytest

from grain_elevator.proto.errors import ResourceExhaustedError, ServiceUnavailableError
from grain_elevator.proto.limits import LONG_STREAM_STEPS
from grain_elevator.server.serving import admission as admission_lib
from grain_elevator.server.serving.admission import Admission


class Request:
  """Stands for a transport's request: records whether it was cancelled."""

  def __init__(self, admission: Admission, steps: int = 1):
    self.cancelled = False
    self.ticket = admission.acquire(cancel=self.cancel, steps=steps)

  def cancel(self) -> None:
    self.cancelled = True


def _age(ticket, *, started_s: float = 0.0, waiting_s: float | None = None,
         sent: int = 0) -> None:
  """Backdates a ticket, as if it had run `started_s` and waited `waiting_s`."""
  now = time.monotonic()
  ticket.started = now - started_s
  ticket.waiting_since = None if waiting_s is None else now - waiting_s
  ticket.sent = sent


def test_refuses_beyond_the_limit_until_a_slot_frees():
  a = Admission(2)
  first, second = Request(a), Request(a)
  with pytest.raises(ResourceExhaustedError, match="maximum of 2"):
    a.acquire()
  first.ticket.release()
  Request(a)
  assert not first.cancelled and not second.cancelled and a.in_flight == 2


def test_a_young_busy_request_keeps_its_slot():
  a = Admission(1)
  busy = Request(a)
  _age(busy.ticket, started_s=admission_lib.SLICE_S * 5, sent=0)  # one slow step
  with pytest.raises(ResourceExhaustedError):
    a.acquire()
  _age(busy.ticket, started_s=0.1, waiting_s=0.1, sent=3)  # reading promptly
  with pytest.raises(ResourceExhaustedError):
    a.acquire()
  assert not busy.cancelled


def test_the_longest_stalled_request_yields_first():
  a = Admission(3)
  reading, stalled, more_stalled = Request(a), Request(a), Request(a)
  _age(reading.ticket, started_s=0.5, waiting_s=0.1, sent=1)
  _age(stalled.ticket, started_s=0.5, waiting_s=admission_lib.STALL_GRACE_S + 1)
  _age(more_stalled.ticket, started_s=0.5, waiting_s=admission_lib.STALL_GRACE_S + 5)
  Request(a)
  assert more_stalled.cancelled and not stalled.cancelled and not reading.cancelled
  assert more_stalled.ticket.released and a.in_flight == 3


def test_a_stream_past_its_slice_yields_when_every_slot_is_taken():
  a = Admission(2)
  long, short = Request(a), Request(a)
  _age(long.ticket, started_s=admission_lib.SLICE_S + 1, waiting_s=0.01, sent=40)
  _age(short.ticket, started_s=0.2, waiting_s=0.01, sent=2)
  Request(a)
  assert long.cancelled and not short.cancelled


def test_requests_without_a_cancel_are_never_chosen():
  a = Admission(1)
  ticket = a.acquire()  # Describe: nothing to cancel with
  _age(ticket, started_s=100, waiting_s=100, sent=5)
  with pytest.raises(ResourceExhaustedError):
    a.acquire()


def test_the_write_timeout_cancels_a_request_whose_client_does_not_read():
  a = Admission(None, write_timeout_s=0.5)
  stalled, reading = Request(a), Request(a)
  _age(stalled.ticket, waiting_s=0.0)
  deadline = time.monotonic() + 60
  while not stalled.cancelled and time.monotonic() < deadline:
    time.sleep(0.1)
  assert stalled.cancelled and not reading.cancelled
  assert a.in_flight == 1


def test_cancellations_are_logged_once_a_period(caplog):
  a = Admission(1)
  with caplog.at_level(logging.WARNING, "grain_elevator.server"):
    for _ in range(5):
      old = Request(a)
      _age(old.ticket, waiting_s=admission_lib.STALL_GRACE_S + 1)
      Request(a).ticket.release()
      assert old.cancelled
  lines = [r.getMessage() for r in caplog.records if "cancelling" in r.getMessage()]
  assert len(lines) == 1, lines


def test_closed_admission_refuses_and_waits_for_those_in_flight():
  a = Admission(4)
  r = Request(a)
  a.close()
  with pytest.raises(ServiceUnavailableError):
    a.acquire()
  assert not a.wait_idle(0.05)
  r.ticket.release()
  assert a.wait_idle(1)


def test_long_streams_hold_at_most_half_the_slots():
  a = Admission(4)
  endless = 10**9
  first, second = Request(a, endless), Request(a, endless)
  with pytest.raises(ResourceExhaustedError, match="may hold 2 of this worker's 4"):
    a.acquire(cancel=lambda: None, steps=LONG_STREAM_STEPS + 1)
  Request(a, LONG_STREAM_STEPS)  # short: the other half is there
  _age(first.ticket, waiting_s=admission_lib.STALL_GRACE_S + 1)
  Request(a, endless)  # a long one may replace a stalled long one
  assert first.cancelled and not second.cancelled and a.in_flight == 3


def test_in_flight_is_told_on_every_admit_and_end_cancellations_included():
  """What the worker tells the supervisor (`--idle-exit-s`): busy from the
  first admit until the last request ends, however it ends."""
  # A write timeout far past the stall grace: the watchdog never ends the
  # stalled one before the newcomer takes its slot, however slow the test.
  write_timeout_s = admission_lib.STALL_GRACE_S + 60
  a = Admission(2, write_timeout_s=write_timeout_s)
  told: list[int] = []
  a.on_in_flight = told.append
  first, second = Request(a), Request(a)
  assert told == [1, 2]
  _age(first.ticket, waiting_s=admission_lib.STALL_GRACE_S + 1)
  third = Request(a)  # takes the stalled one's slot
  assert first.cancelled and told == [1, 2, 2, 2]
  first.ticket.release()  # its transport unwinds: already counted out
  second.ticket.release()
  assert told == [1, 2, 2, 2, 1]
  _age(third.ticket, waiting_s=write_timeout_s)  # the write timeout ends the last one
  deadline = time.monotonic() + 60
  while not third.cancelled and time.monotonic() < deadline:
    time.sleep(0.1)
  assert third.cancelled and told == [1, 2, 2, 2, 1, 0]
  with a():  # Describe
    assert told[-1] == 1
  assert told[-1] == 0 and a.in_flight == 0
