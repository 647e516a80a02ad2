"""The gRPC port's front door (server/serving/front_door.py): with a token
set, a trainer with it gets in while one address holds every connection it
can open without it, and a connection that makes no call with the token is
closed soon after it opens.

On d0747c4, 130 connections from one address, each holding one health
Watch without the token, filled `--max-grpc-connections 48`, and a client
with the token failed Describe for as long as they stayed (the Watch lasted
`--idle-timeout-s`, 300 s by default; a connection with no call as long).
The attacker and the trainer here share one address, 127.0.0.1: only the
token tells them apart, as it does behind one NAT.
"""

from __future__ import annotations

import threading
import time

import pytest

from grain_elevator.client import RetryPolicy, Security
from grain_elevator.client.remote_dataset import describe
from grain_elevator.server.serving import front_door
from grain_elevator.tools.testing.h2peer import H2Peer
from grain_elevator.tools.testing.launcher import LocalServer

TOKEN = "front-door-s3cret"
CAP = 8  # --max-grpc-connections: small, so that one address fills it at once
GUARANTEE_S = 5.0  # the issue's: a client with the token gets in within 5 s
CHECK = "/grpc.health.v1.Health/Check"
WATCH = "/grpc.health.v1.Health/Watch"


@pytest.fixture(scope="module")
def guarded(config_path, tmp_path_factory):
  token = tmp_path_factory.mktemp("door") / "token"
  token.write_text(TOKEN + "\n")
  with LocalServer(config_path, workers=1, extra_args=(
      "--auth-token-file", str(token), "--max-grpc-connections", str(CAP))) as server:
    yield server


def _answered(p: H2Peer, timeout_s: float = 5.0) -> bool:
  """Waits until the server sent its SETTINGS (True) or closed `p` (False)."""
  deadline = time.monotonic() + timeout_s
  while not p.settled and time.monotonic() < deadline:
    try:
      p.read(0.05)
    except ConnectionResetError:
      return False
  return p.settled


def _hold_every_connection(server: LocalServer, watch_every: int = 2) -> list[H2Peer]:
  """Opens connections without the token until the worker closes a newcomer
  at once (its cap is full); every `watch_every`-th holds a health Watch,
  the others nothing. Returns those held."""
  held: list[H2Peer] = []
  for i in range(4 * CAP + 8):
    p = H2Peer(server.host, server.port)
    if not _answered(p):
      break
    if i % watch_every == 0:
      p.open_call(WATCH, declared_bytes=0)
      p.read(0)  # sends the Watch's request message
    held.append(p)
  else:
    raise AssertionError(f"{len(held)} connections and the cap of {CAP} never refused one")
  return held


def test_a_client_with_the_token_gets_in_while_one_address_holds_the_rest(guarded):
  flood = _hold_every_connection(guarded)
  assert len(flood) >= CAP - 1  # every place taken (the worker's at most)
  got_in = threading.Event()
  took: list[float] = []

  def trainer() -> None:  # the project's client, which retries as a trainer does
    start = time.monotonic()
    with_token = Security(auth_token=TOKEN)
    try:
      describe(guarded.target, "plain", security=with_token,
               retry=RetryPolicy(timeout_s=3 * GUARANTEE_S))
    except Exception as e:  # pylint: disable=broad-except
      took.append(-1.0)
      print(f"\nDescribe failed: {e}")
      return
    took.append(time.monotonic() - start)
    got_in.set()
  t = threading.Thread(target=trainer, daemon=True)
  t.start()
  try:
    # Measured on a loaded 2-core machine: 1.3-2.6 s (the flood's connections
    # closed ~1.2 s after they opened; the client's gRPC channel reconnects
    # ~1 s, then ~1.6 s later). On d0747c4: UNAVAILABLE "connections to all
    # backends failing" until the client gave up, 15 s later.
    assert got_in.wait(GUARANTEE_S), (
        f"a client with the token did not get in within {GUARANTEE_S:g} s")
    print(f"\nDescribe with the token took {took[0]:.2f} s")
  finally:
    t.join(4 * GUARANTEE_S)
    for p in flood:
      p.close()


def test_only_connections_without_an_authenticated_call_are_closed(guarded):
  silent = H2Peer(guarded.host, guarded.port)
  anonymous = H2Peer(guarded.host, guarded.port)
  trusted = H2Peer(guarded.host, guarded.port)
  peers = [silent, anonymous, trusted]
  try:
    assert all(map(_answered, peers)), "the worker refused a connection: cap full?"
    refused = anonymous.open_call(CHECK, declared_bytes=0)
    watch = trusted.open_call(WATCH, declared_bytes=0, token=TOKEN)
    opened = time.monotonic()
    deadline = opened + 10 * front_door.UNAUTHENTICATED_GRACE_S + 10
    while not (silent.closed and anonymous.closed) and time.monotonic() < deadline:
      for p in peers:
        if not p.closed:
          try:
            p.read(0.05)
          except ConnectionResetError:
            pass
    closed_after = time.monotonic() - opened
    assert silent.closed and anonymous.closed, "a connection without the token stayed"
    # Health on the gRPC port needs the token when the server has one.
    assert anonymous.statuses().get(refused) == "16"  # UNAUTHENTICATED
    # The connection that carried the token, opened with them, is served still.
    assert not trusted.closed and watch not in trusted.statuses()
    check = trusted.open_call(CHECK, declared_bytes=0, token=TOKEN)
    deadline = time.monotonic() + 10
    while check not in trusted.statuses() and time.monotonic() < deadline:
      trusted.read(0.05)
    assert trusted.statuses().get(check) == "0" and not trusted.closed
    print(f"\nconnections without the token closed {closed_after:.2f} s after opening")
  finally:
    for p in peers:
      p.close()


@pytest.mark.parametrize("peer,key", [
    ("ipv4:10.0.0.7:5123", "10.0.0.7:5123"),
    ("ipv6:[::1]:5123", "::1:5123"),
    ("ipv6:%5B::1%5D:5123", "::1:5123"),
    ("ipv6:[::ffff:10.0.0.7]:5123", "10.0.0.7:5123"),  # a dual-stack listener's IPv4 peer
    ("unix:/tmp/socket", None),
    ("ipv4:not-an-address:1", None),
])
def test_peer_keys_match_what_the_socket_says(peer, key):
  assert front_door.peer_key(peer) == key
