"""How many steps one request asks for: a short time of a worker's work,
within the bytes a request should carry.

A request is made by one server worker, step after step, and the trainer
takes steps in order: while it waits for the request that holds its next
step, that one worker makes it alone, however many others are idle or far
ahead. So a request should take a worker about `REQUEST_S`, not a
fixed number of bytes: at 12 MiB a request, 1 KiB records that take 3 ms
each made requests of ~190 steps, 37 s of one worker, and a default client
got 0.06x of a tuned one (BENCHMARKS.md, "A default client against the
tuned one"). Cheap steps still go `window.REQUEST_BYTES` to a request
(`most`): a request's fixed costs (a round trip, a hand-off, planning its
reads) then stay small beside its bytes.

How long a step takes is the servers' to say: a client that asks
(`BatchRequest.report_production`) gets each step's `production_us`, the
worker's recent average per row scaled to the step
(server/serving/production_time.py). Until the first step arrives a
request asks for one step; a server that says nothing (an older one)
leaves requests sized by bytes. Sizes are powers of two, changed only when
the time moves well past the current one's range, so that a size does not
flap between two values and trainers told the same times cut the same
chunks (client/step_iterator.py routes a chunk by its number, so that the
worker that made it serves it from its cache). Two trainers whose sizes
differ for a while (their first steps, a time at the edge between two
sizes) may have a step made twice: work, never different data.
Embedded mode (no server workers to wait on) and a size the trainer set
keep the bytes rule; stream datasets have their own (client/window.py).
"""

from __future__ import annotations

# What one request should take a worker. Of the order of a tenth of a
# second: a request's own costs are ~1 ms (BENCHMARKS.md), and the trainer
# waits at most about this long on one worker at a step it catches up on.
REQUEST_S = 0.1
# Before any step has arrived: the first window goes out in one-step
# requests, over every worker.
FIRST_STEPS = 1
# A size is kept while the ideal one (REQUEST_S over a step's time)
# stays within [size / SLACK, 2 * size * SLACK).
SLACK = 1.5
# Weight of the latest time in the client's own average of what it is told.
WEIGHT = 0.3


class RequestSize:
  """Steps per request now, following the production times the steps report."""

  def __init__(self, most: int, *, timed: bool):
    """`most`: the steps of REQUEST_BYTES (and within the window's bound);
    `timed`: whether requests are sized by time (else always `most`)."""
    self.most = max(1, most)
    self.timed = timed and self.most > 1  # one step a request either way: nothing to ask
    self.steps = min(FIRST_STEPS, self.most) if self.timed else self.most
    self.step_s: float | None = None  # the client's average of what it was told
    self._told = False  # any step arrived: with a time, or without (a server that says none)

  def observe(self, production_s: float) -> bool:
    """A step arrived saying it took `production_s` to make (0: not said);
    True if the size changed."""
    if not self.timed:
      return False
    if production_s <= 0:
      if self._told:
        return False
      self._told = True  # none said: sized by bytes until one is
      return self._set(self.most)
    self._told = True
    before = self.step_s
    self.step_s = production_s if before is None else before + WEIGHT * (production_s - before)
    return self._set(self._choose(REQUEST_S / self.step_s, fresh=before is None))

  def _choose(self, ideal: float, fresh: bool) -> int:
    """The size for `ideal` steps a request: the current one while `ideal`
    stays in its range (unless it is the first time known: `fresh`), else
    the power of two at or under it, within [1, most]."""
    low, high = self.steps / SLACK, 2 * self.steps * SLACK
    if not fresh and low <= ideal and (ideal < high or self.steps == self.most):
      return self.steps
    power = 1
    while power * 2 <= ideal:
      power *= 2
    return max(1, min(self.most, power))

  def _set(self, steps: int) -> bool:
    changed, self.steps = steps != self.steps, steps
    return changed
