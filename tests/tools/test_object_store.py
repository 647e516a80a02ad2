"""The stand-in object store (tools/testing/object_store.py) answers obstore
as S3 and GCS do: real obstore clients against a real StandInStore
subprocess on 127.0.0.1, for both kinds. No timing is asserted: the time
to first byte is checked by the values drawn, throttling by what is refused."""

from __future__ import annotations

import http.client
import os
import socket
import statistics

import pytest

from grain_elevator.server.data.storage import settings as settings_lib
from grain_elevator.tools.testing import object_store
from grain_elevator.tools.testing.object_store import StandInStore

BUCKET = "standin"
obstore = pytest.importorskip("obstore")
from obstore import exceptions as ox  # pylint: disable=g-import-not-at-top,wrong-import-position
from obstore.store import GCSStore, S3Store  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(scope="module", params=object_store.KINDS)
def store(request, tmp_path_factory):
  with StandInStore(tmp_path_factory.mktemp(request.param), request.param, ttfb=0) as s:
    s.create_bucket(BUCKET)
    yield s


@pytest.fixture
def fresh(store):
  """The store as the fixture made it, its stats reset, after the test too."""
  store.configure(ttfb=0, max_rate=0, bytes_per_s=0, reset=True)
  yield store
  store.configure(ttfb=0, max_rate=0, bytes_per_s=0,
                  max_object_bytes=object_store.DEFAULT_MAX_OBJECT_BYTES, lie="",
                  lie_bytes=object_store.DEFAULT_LIE_BYTES)


def client(s: StandInStore, bucket: str = BUCKET, retries: int = 0):
  """An obstore store for `bucket`, configured from `env()` as settings.py
  configures the server's, without touching this process's environment."""
  env = s.env()
  options = {"allow_http": True}
  retry = {"max_retries": retries}
  if s.kind == "s3":
    return S3Store(bucket, config={"endpoint": env["AWS_ENDPOINT_URL"],
                                   "region": env["AWS_REGION"],
                                   "access_key_id": env["AWS_ACCESS_KEY_ID"],
                                   "secret_access_key": env["AWS_SECRET_ACCESS_KEY"]},
                   client_options=options, retry_config=retry)
  return GCSStore(bucket, config={"base_url": env["STORAGE_EMULATOR_HOST"],
                                  "skip_signature": True,
                                  "service_account_key": env["GOOGLE_SERVICE_ACCOUNT_KEY"]},
                  client_options=options, retry_config=retry)


def path_of(s: StandInStore, key: str) -> str:
  return os.path.join(s.root, BUCKET, key)


def raw(s: StandInStore, method: str, path: str, body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
  conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
  try:
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
  finally:
    conn.close()


def test_the_settings_module_builds_a_client_from_env(store, monkeypatch):
  """`env()` holds all a client needs: settings.py's build_store, reading
  this environment, lists, reads and writes (GCS: its writes signed)."""
  for k, v in store.env().items():
    monkeypatch.setenv(k, v)
  scheme = "s3" if store.kind == "s3" else "gs"
  s = settings_lib.build_store(scheme, BUCKET, settings_lib.StorageSettings(retry_s=5.0))
  obstore.put(s, "env/one.bin", b"through the environment")
  assert bytes(obstore.get(s, "env/one.bin").bytes()) == b"through the environment"
  assert [m["path"] for m in obstore.list(s, prefix="env").collect()] == ["env/one.bin"]


def test_list_pages_at_1000_with_a_prefix(fresh):
  keys = [f"paged/{i:05d}.bin" for i in range(2100)]
  for k in keys:
    fresh.put(BUCKET, k, b"x" * (len(k) % 5))
  fresh.put(BUCKET, "paged/deeper/a.bin", b"a")
  fresh.put(BUCKET, "pagedness.bin", b"not under the folder")
  with open(path_of(fresh, "paged/.standin-leftover"), "wb") as f:  # never listed
    f.write(b"a temporary file of the store's")
  requests = fresh.stats()["requests"]
  pages = list(obstore.list(client(fresh), prefix="paged", chunk_size=1000))
  listed = [m for page in pages for m in page]
  assert [m["path"] for m in listed] == sorted(keys + ["paged/deeper/a.bin"])
  assert fresh.stats()["requests"] - requests == 3  # 1000, 1000 and 101 keys
  first = listed[0]
  assert first["size"] == os.path.getsize(path_of(fresh, first["path"]))
  assert first["e_tag"] == object_store.etag_of(os.stat(path_of(fresh, first["path"])))
  folders = obstore.list_with_delimiter(client(fresh), prefix="paged")
  assert folders["common_prefixes"] == ["paged/deeper"]
  assert len(folders["objects"]) == len(keys)


def test_head_gives_size_etag_and_generation(fresh):
  fresh.put(BUCKET, "head/one.bin", b"12345")
  meta = obstore.head(client(fresh), "head/one.bin")
  st = os.stat(path_of(fresh, "head/one.bin"))
  assert meta["size"] == 5
  assert meta["e_tag"] == object_store.etag_of(st)
  assert meta["version"] == (str(st.st_mtime_ns) if fresh.kind == "gcs" else None)


def test_ranged_gets_return_the_files_bytes(fresh):
  data = os.urandom(700_000)  # past one piece: a long range is streamed
  fresh.put(BUCKET, "range/a b+c.bin", data)  # a space and a plus: escaped on the way
  s = client(fresh)
  for begin, end in ((0, 1), (10, 3090), (699_000, 700_000), (1, 600_000)):
    got = obstore.get(s, "range/a b+c.bin", options={"range": (begin, end)})
    assert bytes(got.bytes()) == data[begin:end]
  assert bytes(obstore.get(s, "range/a b+c.bin", options={"range": {"suffix": 7}}).bytes()) \
      == data[-7:]
  assert bytes(obstore.get(s, "range/a b+c.bin", options={"range": {"offset": 699_990}})
               .bytes()) == data[699_990:]
  assert bytes(obstore.get(s, "range/a b+c.bin").bytes()) == data
  stats = fresh.stats()
  assert stats["ranged_gets"] == 6
  assert stats["statuses"] == {"200": 1, "206": 6}
  assert stats["body_bytes"] == 1 + 3080 + 1000 + 599_999 + 7 + 10 + len(data)


def test_a_paced_body_arrives_whole(fresh):
  data = os.urandom(300_000)
  fresh.put(BUCKET, "paced/one.bin", data)
  fresh.configure(bytes_per_s=20e6)
  assert bytes(obstore.get(client(fresh), "paced/one.bin",
                           options={"range": (5, 300_000)}).bytes()) == data[5:]


def test_if_match_mismatch_is_a_precondition_error(fresh):
  fresh.put(BUCKET, "cond/one.bin", b"abc")
  s = client(fresh)
  etag = obstore.head(s, "cond/one.bin")["e_tag"]
  assert bytes(obstore.get(s, "cond/one.bin", options={"range": (0, 2), "if_match": etag})
               .bytes()) == b"ab"
  with pytest.raises(ox.PreconditionError):
    obstore.get(s, "cond/one.bin", options={"range": (0, 2), "if_match": '"other"'})
  assert fresh.stats()["statuses"]["412"] == 1


def test_a_replaced_object_refuses_a_read_pinned_as_the_server_pins(fresh):
  """objects.py pins a GCS read to its generation (another answers 404) and
  an S3 read to its ETag (If-Match: 412); a replaced object has new ones."""
  s = client(fresh)
  obstore.put(s, "pin/one.bin", b"first")
  before = obstore.head(s, "pin/one.bin")
  obstore.put(s, "pin/one.bin", b"again")
  after = obstore.head(s, "pin/one.bin")
  assert after["e_tag"] != before["e_tag"]
  if fresh.kind == "gcs":
    assert int(after["version"]) > int(before["version"])
    with pytest.raises(FileNotFoundError):
      obstore.get(s, "pin/one.bin", options={"range": (0, 5), "version": before["version"]})
    got = obstore.get(s, "pin/one.bin", options={"range": (0, 5), "version": after["version"]})
  else:
    with pytest.raises(ox.PreconditionError):
      obstore.get(s, "pin/one.bin", options={"range": (0, 5), "if_match": before["e_tag"]})
    got = obstore.get(s, "pin/one.bin", options={"range": (0, 5), "if_match": after["e_tag"]})
  assert bytes(got.bytes()) == b"again"


def test_put_get_copy_and_delete(fresh):
  s = client(fresh)
  put = obstore.put(s, "rw/new.bin", b"hello")
  assert put["e_tag"] == object_store.etag_of(os.stat(path_of(fresh, "rw/new.bin")))
  assert bytes(obstore.get(s, "rw/new.bin").bytes()) == b"hello"
  with pytest.raises(ox.AlreadyExistsError):
    obstore.put(s, "rw/new.bin", b"no", mode="create")
  obstore.copy(s, "rw/new.bin", "rw/copy.bin")
  assert bytes(obstore.get(s, "rw/copy.bin").bytes()) == b"hello"
  big = os.urandom(11 << 20)  # obstore uploads it in parts
  obstore.put(s, "rw/big.bin", big)
  assert bytes(obstore.get(s, "rw/big.bin", options={"range": (5 << 20, 11 << 20)}).bytes()) \
      == big[5 << 20:]
  obstore.delete(s, "rw/new.bin")
  assert not os.path.exists(path_of(fresh, "rw/new.bin"))
  with pytest.raises(FileNotFoundError):
    obstore.head(s, "rw/new.bin")
  if fresh.kind == "gcs":  # GCS: 404; S3 reports a missing key deleted
    with pytest.raises(FileNotFoundError):
      obstore.delete(s, "rw/new.bin")
  else:
    obstore.delete(s, "rw/new.bin")
  assert sorted(os.listdir(path_of(fresh, "rw"))) == ["big.bin", "copy.bin"]  # no temporary
  uploads = os.path.join(fresh.root, object_store.HIDDEN + "uploads")
  assert not os.path.exists(uploads) or os.listdir(uploads) == []


def test_missing_objects_and_buckets_are_404_with_the_xml_code(fresh):
  with pytest.raises(FileNotFoundError, match="404"):
    obstore.head(client(fresh), "nowhere.bin")
  with pytest.raises(FileNotFoundError, match="404"):
    obstore.get(client(fresh), "nowhere.bin", options={"range": (0, 4)})
  with pytest.raises(Exception, match="404"):
    list(obstore.list(client(fresh, bucket="no-such-bucket")))
  key = "nowhere%2Fat%20all.bin" if fresh.kind == "gcs" else "nowhere/at%20all.bin"
  status, headers, body = raw(fresh, "GET", f"/{BUCKET}/{key}")
  assert (status, headers["content-type"]) == (404, "application/xml")
  assert b"<Code>NoSuchKey</Code>" in body
  status, _, body = raw(fresh, "GET", "/no-such-bucket/key.bin")
  assert status == 404 and b"<Code>NoSuchBucket</Code>" in body


def test_past_max_rate_a_prefix_is_refused_as_the_store_does(fresh):
  """A token bucket per prefix with a one-second burst: 40 requests at 2/s
  get at most 2 + 2 * (seconds they took) through; another prefix is not
  held back by this one's."""
  fresh.put(BUCKET, "hot/one.bin", b"x")
  fresh.put(BUCKET, "cool/one.bin", b"y")
  fresh.configure(max_rate=2, reset=True)
  refusal = 503 if fresh.kind == "s3" else 429
  conn = http.client.HTTPConnection("127.0.0.1", fresh.port, timeout=30)
  statuses, bodies = [], []
  for _ in range(40):
    conn.request("GET", f"/{BUCKET}/hot/one.bin", headers={"Range": "bytes=0-0"})
    r = conn.getresponse()
    statuses.append(r.status)
    bodies.append(r.read())
  conn.close()
  refused = statuses.count(refusal)
  assert refused >= 1 and set(statuses) == {206, refusal}
  if fresh.kind == "s3":
    assert b"<Code>SlowDown</Code>" in bodies[statuses.index(503)]
  with pytest.raises(Exception, match=str(refusal)):  # obstore, retries off
    obstore.get(client(fresh), "hot/one.bin", options={"range": (0, 1)})
  assert bytes(obstore.get(client(fresh), "cool/one.bin").bytes()) == b"y"
  stats = fresh.stats()
  assert stats["refused"] == refused + 1
  assert stats["statuses"][str(refusal)] == refused + 1


def test_the_ttfb_distribution_has_the_asked_quantiles():
  draw = object_store.Ttfb(0.025, 0.150, seed=3)
  values = sorted(draw() for _ in range(40_000))
  assert values[len(values) // 2] == pytest.approx(0.025, rel=0.05)
  assert values[int(len(values) * 0.99)] == pytest.approx(0.150, rel=0.10)
  a, b = object_store.Ttfb(0.01, 0.05, seed=9), object_store.Ttfb(0.01, 0.05, seed=9)
  assert [a() for _ in range(100)] == [b() for _ in range(100)]
  assert object_store.Ttfb(0.0, 0.0)() == 0.0
  assert statistics.pstdev(object_store.Ttfb(0.02, 0.02, seed=1)() for _ in range(10)) == 0


def test_the_server_delays_by_the_seeded_draws(fresh):
  """The server draws one delay per storage request, in order from its
  seed: what it reports equals the pure function's draws."""
  fresh.put(BUCKET, "slow/one.bin", b"abc")
  fresh.configure(ttfb_p50_ms=1, ttfb_p99_ms=4, seed=11, reset=True)
  s = client(fresh)
  for _ in range(20):
    obstore.head(s, "slow/one.bin")
  stats = fresh.stats()
  draw = object_store.Ttfb(0.001, 0.004, seed=11)
  assert stats["ttfb_draws"] == 20
  assert stats["ttfb_sum_s"] == pytest.approx(sum(draw() for _ in range(20)))
  assert stats["in_flight"] == 0 and stats["in_flight_peak"] == 1
  assert 0 < stats["in_flight_mean"] <= 1


def test_oversized_headers_and_bodies_are_refused(fresh):
  with socket.create_connection(("127.0.0.1", fresh.port), timeout=30) as sock:
    sock.sendall(f"GET /{BUCKET}/x HTTP/1.1\r\nHost: a\r\nX-Big: {'y' * 17_000}\r\n\r\n"
                 .encode())
    answer = b"".join(iter(lambda: sock.recv(65536), b""))  # then it closes
  assert answer.startswith(b"HTTP/1.1 431 ")
  fresh.put(BUCKET, "big/one.bin", b"x")
  status, _, _ = raw(fresh, "GET", f"/{BUCKET}/big/one.bin",
                     headers={"X-Big": "y" * 15_000})
  assert status == 200
  fresh.configure(max_object_bytes=1000)
  with socket.create_connection(("127.0.0.1", fresh.port), timeout=30) as sock:
    sock.sendall(f"PUT /{BUCKET}/big/two.bin HTTP/1.1\r\nHost: a\r\nContent-Length: 2000\r\n\r\n"
                 .encode())  # no body: refused from the headers
    answer = b"".join(iter(lambda: sock.recv(65536), b""))
  assert answer.startswith(b"HTTP/1.1 413 ")
  assert not os.path.exists(path_of(fresh, "big/two.bin"))


@pytest.mark.parametrize("lie", [lie for lie in object_store.LIES if lie])
def test_a_lying_store_answers_a_range_wrongly_as_told(fresh, lie):
  """Each `lie` of a ranged GET, as a raw socket reads it (the answer's
  head, then its body to the connection's close)."""
  data = bytes(range(256)) * 4
  fresh.put(BUCKET, "lie/one.bin", data)
  fresh.configure(lie=lie, lie_bytes=5000)
  key = "lie%2Fone.bin" if fresh.kind == "gcs" else "lie/one.bin"
  with socket.create_connection(("127.0.0.1", fresh.port), timeout=30) as sock:
    sock.sendall(f"GET /{BUCKET}/{key} HTTP/1.1\r\nRange: bytes=10-19\r\n"
                 "Connection: close\r\n\r\n".encode())
    answer = b"".join(iter(lambda: sock.recv(65536), b""))
  head, _, body = answer.partition(b"\r\n\r\n")
  want = {"whole": (b"HTTP/1.1 200 ", None, str(len(data)), data),
          "shifted": (b"HTTP/1.1 206 ", "bytes 11-20/1024", "10", data[11:21]),
          "no_length": (b"HTTP/1.1 206 ", "bytes 10-19/1024", None, data[10:20]),
          "oversized": (b"HTTP/1.1 206 ", "bytes 10-19/1024", "5000",
                        data[10:20] + bytes(4990))}[lie]
  headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
  assert head.startswith(want[0])
  assert headers.get("Content-Range") == want[1]
  assert headers.get("Content-Length") == want[2]
  assert body == want[3]
  fresh.configure(lie="")
  assert bytes(obstore.get(client(fresh), "lie/one.bin", options={"range": (10, 20)})
               .bytes()) == data[10:20]


def test_pipelined_requests_are_answered_in_order(fresh):
  fresh.put(BUCKET, "pipe/a.bin", b"AAAA")
  fresh.put(BUCKET, "pipe/b.bin", b"BBBB")
  key = "pipe%2F" if fresh.kind == "gcs" else "pipe/"
  with socket.create_connection(("127.0.0.1", fresh.port), timeout=30) as sock:
    sock.sendall(f"GET /{BUCKET}/{key}a.bin HTTP/1.1\r\nRange: bytes=1-2\r\n\r\n"
                 f"GET /{BUCKET}/{key}b.bin HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
    answer = b"".join(iter(lambda: sock.recv(65536), b""))
  first, _, second = answer.partition(b"\r\n\r\nAA")
  assert first.startswith(b"HTTP/1.1 206 ") and b"Content-Range: bytes 1-2/4" in first
  assert second.startswith(b"HTTP/1.1 200 ") and second.endswith(b"\r\n\r\nBBBB")


def test_in_thread(tmp_path):
  with StandInStore(tmp_path, "s3", in_thread=True, ttfb=0) as s:
    s.put("b", "k.bin", b"in a thread")
    assert bytes(obstore.get(client(s, "b"), "k.bin").bytes()) == b"in a thread"
    assert s.stats()["pid"] == os.getpid()
