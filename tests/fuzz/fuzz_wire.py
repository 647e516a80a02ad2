"""Fuzzes what crosses the wire: the client's decoding of batches, the bulk
server's framing and the bulk client's, in one process, taking turns.

    python tests/fuzz/fuzz_wire.py --seconds 60 --seed 1 --out fuzz-findings
    python tests/fuzz/fuzz_wire.py --replay fuzz-findings/wire-0001-decode-....json

Why: a trainer decodes whatever a replica sends (an impostor, a bad build,
corrupted memory), and a worker's bulk port reads whatever any peer sends.
Three targets share the time:
  * decode: Batch messages, real (proto/wire.py's encoder on the test
    datasets' element specs, with and without zstd, eval mode's '_mask',
    fixed-size bytes and other dtypes; a live server's answers) and crafted
    (zstd bombs of 2 GiB in 64 KiB, shapes whose product overflows int64,
    huge varints, truncated tensors, leaves missing or extra), mutated in
    structure (leaves, dtypes, shapes, data, codecs, varints, lengths) and in
    bytes, each through proto/wire.py `decode_batch_bytes` with the spec's
    leaves and through client/transport/connection.py `decode_step` (which adds the
    frame limit and the step). Each must come back exactly as the spec says
    (dtype, shape, bytes) or be refused: BadBatchError, BadReplyError;
  * server: sessions of mutated greetings, frame headers and requests
    (9-byte payloads, lengths about MAX_REQUEST_BYTES, kinds out of range),
    sent in random pieces to a live `elevator serve`. What it answers must be
    exactly what a model of the protocol predicts (the answers computed by
    the request path in this process) up to where it drops a peer that
    broke the protocol, and it closes every connection: at once after a
    half-close or a broken frame, after its timeouts when the peer goes
    quiet. It never dies, never logs a traceback, and default RemoteDatasets
    still read the exact streams at the end;
  * client: a fake bulk server (a thread) sends mutated HELLO, BATCH and
    STATUS frames to client/transport/bulk_connection.py's BulkConnection, which must raise a
    TransportError (BadReplyError included) or yield the steps the spec allows.
This process runs under an address-space limit (--memory-mb over what it
holds after setting up), and no input may raise its peak RSS by more than
--rss-jump-mb: an allocation sized by the wire is a finding, not a machine
out of memory. Any other exception, an input that takes longer than
--timeout, or a real input that does not come back as itself is a finding
too. The first --keep findings of each kind are printed and saved under
--out (wire-*.json, which --replay runs again; decode inputs also as .bin),
the rest counted; the run exits 1 if there were any.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import faulthandler
import itertools
import json
import logging
import mmap
import os
import pathlib
import pickle
import queue
import random
import re
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import numpy as np
import zstandard
from google.protobuf.message import DecodeError

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
# pylint: disable=g-import-not-at-top,wrong-import-position
import conftest  # the test datasets (CONFIG, IMAGE, NUM_RECORDS, DATASETS)
import mutate  # zstd frames of many layouts (the shard reader's fuzzer)
from helpers import assert_streams_equal

from grain_elevator.client import RemoteDataset, Security, TransportOptions
from grain_elevator.client.transport import connection as transport
from grain_elevator.client.transport.bulk_connection import BulkConnection
from grain_elevator.pipelines import examples
from grain_elevator.proto import dtypes
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto import errors
from grain_elevator.proto import framing
from grain_elevator.proto import varint
from grain_elevator.proto import wire
from grain_elevator.proto.limits import MAX_REQUEST_BYTES
from grain_elevator.proto.spec import ElementSpec, LeafSpec
from grain_elevator.server.data import config as config_lib
from grain_elevator.server.data import registry
from grain_elevator.server.serving.bulk import HANDSHAKE_TIMEOUT_S
from grain_elevator.server.serving.request_path import RequestPath
from grain_elevator.tools.testing.launcher import LocalServer
# pylint: enable=g-import-not-at-top,wrong-import-position

PREFIX = "fuzz-wire:"
HARNESS_FAILED = 3  # a child's exit status when the fuzzer itself failed
TOKEN = "fuzz-token-0123456789"
IDLE_TIMEOUT_S = 3.0  # the server's --idle-timeout-s: quiet peers are closed soon
# The server's --max-message-bytes, and the model's: batches stay small.
MAX_MESSAGE_BYTES = 4 << 20
# The model follows a request's answer this far; the session reads that much
# of it and hangs up (a stream may be as long as num_steps says).
CAP_STEPS, CAP_BYTES = 12, 8 << 20
EDGES = (0, 1, 2, 7, 8, 9, 127, 128, 255, 256, 4095, 4096, 65_535, 65_536,
         MAX_REQUEST_BYTES - 1, MAX_REQUEST_BYTES, MAX_REQUEST_BYTES + 1, (1 << 20) + 1,
         (1 << 31) - 1, 1 << 31, 1 << 32, (1 << 32) + 1, 1 << 62, (1 << 63) - 1, 1 << 63,
         (1 << 64) - 1, (1 << 70) - 1)
INT64_EDGES = (-(1 << 63), -(1 << 31), -2, -1, 0, 1, 2, 3, 63, 64, 65, 999, 1000, 1001,
               65_536, 60_000, (1 << 31) - 1, 1 << 31, 1 << 40, (1 << 62), (1 << 63) - 1)


class Hang(BaseException):
  """An input ran past --timeout (raised by SIGALRM; a BaseException so that
  no `except Exception` in the code under test swallows it)."""


class HarnessError(RuntimeError):
  """The fuzzer itself went wrong (not a finding in the code under test)."""


def _on_alarm(signum, frame):  # pylint: disable=unused-argument
  raise Hang()


def _peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _vm_size() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmSize:"):
        return int(line.split()[1]) * 1024
  raise HarnessError("no VmSize in /proc/self/status")


def _steps(path: RequestPath, request: pb.BatchRequest, token: str | None = None) -> Any:
  """What the request path answers `request` (the model's oracle)."""
  with path.admitted(token) as ticket:
    for step, leaves, _ in path.steps(ticket, request):
      yield step, leaves


def _escaped(e: BaseException, what: str) -> str:
  """`e` as a finding: its type, what it escaped, where it was raised, its
  message (the finding's kind is what comes before the message)."""
  tb = traceback.extract_tb(e.__traceback__)
  where = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno} {tb[-1].name}" if tb else ""
  return f"{type(e).__name__} escaped {what}{where}: {str(e)[:300]}"


# ---------------------------------------------------------------------------
# Protobuf surgery: a message as editable fields, written back with odd
# varints and lying lengths where a mutation asks for them.

@dataclasses.dataclass
class Field:
  number: int
  wire_type: int
  value: Any  # int (VARINT), bytes, or list[Field] (a Tensor inside a Batch)
  length: int | None = None  # a LEN field's declared length, if it lies


def parse(message: bytes, tensors: bool = True) -> list[Field]:
  """The fields of a (well-formed) Batch; field 2 parsed as Tensors."""
  out = []
  for number, wire_type, value in varint.fields(message):
    if wire_type == varint.LEN:
      value = bytes(value)
      if tensors and number == 2:
        value = parse(value, tensors=False)
    out.append(Field(number, wire_type, value))
  return out


def odd_varint(rng: random.Random, value: int) -> bytes:
  """`value` in an encoding the encoder would not write: padded with
  continuation bytes (valid protobuf), or 11 bytes, or overflowing 64 bits."""
  plain = varint.encode(value)
  r = rng.random()
  if r < 0.6 and len(plain) < 10:
    pad = rng.randint(1, 10 - len(plain))
    return bytes(b | 0x80 for b in plain) + b"\x80" * (pad - 1) + b"\x00"
  if r < 0.8:
    return b"\xff" * 9 + bytes([rng.choice((0x02, 0x7f))])  # > 2**64
  return bytes(b | 0x80 for b in plain) + b"\x80" * max(0, 11 - len(plain)) + b"\x01"


class Writer:
  """Writes fields back; `odd` of the varints in an odd encoding."""

  def __init__(self, rng: random.Random | None = None, odd: float = 0.0):
    self.rng, self.odd, self.odd_count = rng, odd, 0

  def varint(self, value: int) -> bytes:
    if self.rng is not None and self.odd and self.rng.random() < self.odd:
      self.odd_count += 1
      return odd_varint(self.rng, value)
    return varint.encode(value)

  def message(self, fields: list[Field]) -> bytes:
    out = bytearray()
    for f in fields:
      out += self.varint(f.number << 3 | f.wire_type)
      if f.wire_type == varint.VARINT:
        out += self.varint(f.value)
      elif f.wire_type == varint.LEN:
        body = self.message(f.value) if isinstance(f.value, list) else f.value
        out += self.varint(len(body) if f.length is None else f.length) + body
      else:  # fixed-size, groups, wire types 6 and 7: raw bytes as given
        out += f.value
    return bytes(out)


def _tensors(fields: list[Field]) -> list[Field]:
  return [f for f in fields if f.number == 2 and isinstance(f.value, list)]


def _get(tensor: Field, number: int) -> Field | None:
  return next((f for f in tensor.value if f.number == number), None)


def _dims(f: Field | None) -> list[int]:
  """The dims of a shape field as written, even ones an earlier mutation
  made over 64 bits (which proto/varint.py refuses)."""
  if f is None:
    return []
  if f.wire_type == varint.VARINT:
    return [f.value]
  dims, d, shift = [], 0, 0
  for byte in f.value:
    d |= (byte & 0x7F) << shift
    shift += 7
    if not byte & 0x80:
      dims.append(d)
      d = shift = 0
  return dims


def _packed(dims: list[int]) -> bytes:
  return b"".join(varint.encode(d) for d in dims)


def zstd_bomb(size: int, *, declare: bool, claim: int | None = None) -> bytes:
  """A zstd frame of `size` zero bytes in 128 KiB RLE blocks of 4 bytes each
  (2 GiB in 64 KiB). `declare`: the header states a content size, `claim`
  if given (a lie), else `size`."""
  block = 1 << 17
  assert size % block == 0
  fcs_flag = 3 if declare else 0
  header = mutate.layout.ZSTD_MAGIC + bytes([fcs_flag << 6, (17 - 10) << 3])
  if declare:
    header += (size if claim is None else claim).to_bytes(8, "little")
  blocks = bytearray()
  for i in range(size // block):
    last = i == size // block - 1
    blocks += (int(last) | 1 << 1 | block << 3).to_bytes(3, "little") + b"\x00"
  return header + bytes(blocks)


# ---------------------------------------------------------------------------
# The corpus: real batches of real element specs, crafted ones, streams.

@dataclasses.dataclass
class Seed:
  """One Batch message and what it must decode to."""
  name: str
  dataset: str
  expect: tuple[LeafSpec, ...]
  step: int
  data: bytes
  values: list[bytes] | None  # each leaf's bytes; None: crafted, must be refused
  fields: list[Field] = dataclasses.field(default_factory=list)
  # A crafted seed whose lie only the client's step decoding sees (a step).
  decoder_may_accept: bool = False


@dataclasses.dataclass
class Stream:
  """A request and the Batch messages a true server answers it with."""
  name: str
  request: pb.BatchRequest
  expect: tuple[LeafSpec, ...]
  limit: int  # the frame limit the client's pool gives it (ElementSpec.max_batch_bytes)
  seeds: list[Seed]


# Element specs beyond the test datasets': (leaf, dtype, per-row shape).
SYNTHETIC: dict[str, list[tuple[str, str, tuple[int, ...]]]] = {
    "dtypes": [("f16", "float16", (3, 5)), ("i32", "int32", (7,)), ("u64", "uint64", ()),
               ("flag", "bool", (2,)), ("c64", "complex64", (2,)), ("word", "S7", ()),
               ("text", "<U3", ()), ("blob", "V5", ()), ("empty", "float32", (0,)),
               ("i8", "int8", (4, 1, 2))],
    "tokens": [("_mask", "bool", ()), ("tokens", "int32", (33,)), ("segment", "uint16", (33,))],
}
# dtype strings a mutant may take: valid, odd, and pieces of numpy's grammar.
DTYPE_WORDS = ("O", "object", "<U0", "V0", "S0", "|S0", "U", "S", "V", "a", ">f4", ">i8",
               "=i4", "|u1", "f8,i4", "(2,)u1", "(2,3)f4", "(0,)u1", "M8", "M8[s]",
               "m8[us]", "M8[s/2]", "m8[7ms]", "datetime64[Y]", "float128", "longdouble", "c32", "b1", "?",
               "str", "bytes", "void", "int", "float", "u1", "i8", "f4", "bool", "uint8",
               "int64", "float32", "S64", "<S64", "U1073741824", "S2147483648",
               "V9223372036854775807", "", "\xff", "\u00e9", "\x00")
DTYPE_TOKENS = ("(", ")", ",", "[", "]", "<", ">", "|", "=", "/", "0", "1", "2", "9" * 12, "e9",
                ".", "-", " ", "S", "U", "V", "M8", "m8", "i", "u", "f", "c", "b", "O", "?",
                "'", ":", "x", "\x00", "\u00e9")


def frame_limit(expect: tuple[LeafSpec, ...]) -> int:
  """The longest message a step of these leaves may be, as the client's pool
  computes it (ElementSpec.max_batch_bytes)."""
  return wire.max_batch_bytes(sum(l.nbytes for l in expect), len(expect))


def _values(leaves: list[np.ndarray]) -> list[bytes]:
  return [np.ascontiguousarray(a).tobytes() for a in leaves]


def _seed(name: str, dataset: str, expect: tuple[LeafSpec, ...], step: int,
          leaves: list[np.ndarray], compression: int, production_us: int = 0) -> Seed:
  """A Batch as the encoder writes it; `production_us`: with the time a
  server adds after it for a client that asks (report_production)."""
  data = (wire.encode_batch_bytes(step, leaves, compression)
          + wire.production_field(production_us))
  seed = Seed(name, dataset, expect, step, data, _values(leaves), parse(data))
  if Writer().message(seed.fields) != data:
    raise HarnessError(f"the fuzzer's protobuf writer does not reproduce seed {name}")
  return seed


def real_streams(path: RequestPath) -> list[Stream]:
  """Steps of every test dataset, as the request path makes them and the
  encoder writes them: small and big batches (zstd only compresses tensors of
  wire.MIN_COMPRESSED_BYTES or more; G=1000 lets a 64 KiB bomb under the
  frame limit), first and last steps (eval mode's last is padded, its
  '_mask' False there)."""
  out = []
  for name in conftest.DATASETS:
    with path.admitted(None) as ticket:
      (info,) = path.describe(ticket, pb.DescribeRequest(dataset=name))
    spec = info.element_spec
    for g, h, n in ((8, 1, 2), (128, 0, 1), (96, 0, 1), (1000, 0, 1)):
      total = info.total_steps(g) or 50
      for start, k in sorted({(0, min(2, total)), (total - 1, 1)}):
        for compression in (wire.COMPRESSION_NONE, wire.COMPRESSION_ZSTD):
          request = pb.BatchRequest(dataset=name, global_batch_size=g, shard_index=h,
                                    shard_count=n, start_step=start, num_steps=k,
                                    compression=compression)
          rows = g // n
          expect = spec.batch_leaves(rows)
          seeds = [_seed(f"{name} G={g} {h}/{n} step {step} {'zstd' if compression else 'raw'}",
                         name, expect, step, [np.asarray(a) for a in leaves], compression)
                   for step, leaves in _steps(path, request)]
          out.append(Stream(seeds[0].name + f" x{k}", request, expect,
                            spec.max_batch_bytes(rows), seeds))
  return out


def synthetic_streams(rng: random.Random) -> list[Stream]:
  """Batches of the SYNTHETIC specs: random and compressible values."""
  out = []
  for name, leaves in SYNTHETIC.items():
    spec = ElementSpec(None, tuple(LeafSpec(p, np.dtype(d), s) for p, d, s in leaves))
    for rows in (3, 200):
      expect = spec.batch_leaves(rows)
      for compression in (wire.COMPRESSION_NONE, wire.COMPRESSION_ZSTD):
        arrays = []
        for leaf in expect:
          n = leaf.nbytes
          raw = rng.randbytes(n) if rng.random() < 0.5 else bytes(n // 2) + rng.randbytes(n - n // 2)
          arrays.append(np.frombuffer(raw, dtype=leaf.dtype).reshape(leaf.shape))
        seed = _seed(f"{name} rows={rows} {'zstd' if compression else 'raw'}", name, expect,
                     rng.randrange(1000), arrays, compression,
                     rng.choice((0, 0, 1, 190_000, 2**40)))
        request = pb.BatchRequest(dataset=name, global_batch_size=rows, shard_count=1,
                                  start_step=seed.step, num_steps=1, compression=compression)
        out.append(Stream(seed.name, request, expect, spec.max_batch_bytes(rows), [seed]))
  return out


def crafted_seeds(base: Seed, eval_seed: Seed) -> list[Seed]:
  """Batches that must be refused, built from `base` (a 'plain' step of
  G=128: id, image uint8[128,4,4,3], label) and `eval_seed` (with '_mask')."""
  image_size = base.expect[1].nbytes
  out = []

  def craft(name: str, edit: Callable[[list[Field]], Any], seed: Seed = base) -> None:
    fields = copy.deepcopy(seed.fields)
    edit(fields)
    out.append(Seed(f"crafted: {name}", seed.dataset, seed.expect, seed.step,
                    Writer().message(fields), None, fields))

  def image(fields: list[Field]) -> Field:
    return _tensors(fields)[1]

  def set_data(data: bytes, codec: int) -> Callable[[list[Field]], None]:
    def edit(fields: list[Field]) -> None:
      t = image(fields)
      t.value = [f for f in t.value if f.number not in (3, 4)]
      t.value += [Field(3, varint.LEN, data), Field(4, varint.VARINT, codec)]
    return edit

  def set_shape(dims: list[int], packed: bool = True) -> Callable[[list[Field]], None]:
    def edit(fields: list[Field]) -> None:
      t = image(fields)
      at = next(i for i, f in enumerate(t.value) if f.number == 2)
      new = ([Field(2, varint.LEN, _packed(dims))] if packed
             else [Field(2, varint.VARINT, d) for d in dims])
      t.value[at:at + 1] = new
    return edit

  craft("zstd bomb of 2 GiB, size declared", set_data(zstd_bomb(2 << 30, declare=True), 1))
  craft("zstd bomb of 2 GiB, size not declared", set_data(zstd_bomb(2 << 30, declare=False), 1))
  craft("zstd bomb of 2 GiB declaring the leaf's size",
        set_data(zstd_bomb(2 << 30, declare=True, claim=image_size), 1))
  craft("shape [2**32, 2**32, 4]", set_shape([1 << 32, 1 << 32, 4]))
  craft("shape [2**63, 2], unpacked", set_shape([1 << 63, 2], packed=False))
  craft("shape [2**64-1]", set_shape([(1 << 64) - 1]))
  craft("shape [2**70-1, 0]", set_shape([(1 << 70) - 1, 0]))
  craft("shape product 2**64 exactly, zstd data",
        lambda f: (set_shape([1 << 32, 1 << 32])(f), set_data(zstd_bomb(1 << 17, declare=False), 1)(f)))

  def huge_data_length(fields: list[Field]) -> None:
    _get(image(fields), 3).length = (1 << 64) - 1

  def huge_tensor_length(fields: list[Field]) -> None:
    image(fields).length = 1 << 63

  def huge_step(fields: list[Field]) -> None:
    fields.insert(0, Field(1, varint.VARINT, (1 << 70) - 1))

  craft("Tensor.data length 2**64-1", huge_data_length)
  craft("Tensor length 2**63", huge_tensor_length)
  craft("step 2**70-1", huge_step)
  out[-1].decoder_may_accept = True
  out.append(Seed("crafted: an 11-byte key varint", base.dataset, base.expect, base.step,
                  b"\x88" + b"\x80" * 9 + b"\x00" + base.data, None, base.fields))

  def truncated(fields: list[Field]) -> None:
    d = _get(image(fields), 3)
    d.value = d.value[:-1]

  craft("image data 1 byte short", truncated)
  out.append(Seed("crafted: message cut in the image data", base.dataset, base.expect,
                  base.step, base.data[:len(base.data) // 2], None, base.fields))
  craft("a leaf missing", lambda f: f.remove(_tensors(f)[2]))
  craft("a leaf extra", lambda f: f.append(copy.deepcopy(_tensors(f)[0])))

  def mask_as_uint8(fields: list[Field]) -> None:
    _get(_tensors(fields)[0], 1).value = b"uint8"

  craft("eval '_mask' leaf as uint8", mask_as_uint8, eval_seed)
  craft("eval '_mask' leaf missing", lambda f: f.remove(_tensors(f)[0]), eval_seed)
  return out


# ---------------------------------------------------------------------------
# Mutations of a Batch: in structure (written back with odd varints
# sometimes), then in bytes.

def _edit_leaves(rng: random.Random, fields: list[Field], other: Seed) -> str:
  tensors = _tensors(fields)
  r = rng.random()
  if not tensors or r < 0.15:
    donor = _tensors(other.fields)
    if donor:
      t = copy.deepcopy(rng.choice(donor))
      fields.insert(rng.randint(0, len(fields)), t)
      return f"a leaf of {other.name!r} inserted"
    return "no leaf"
  t = rng.choice(tensors)
  if r < 0.4:
    fields.remove(t)
    return "a leaf dropped"
  if r < 0.6:
    fields.insert(rng.randint(0, len(fields)), copy.deepcopy(t))
    return "a leaf duplicated"
  if r < 0.85 and len(tensors) > 1:
    a, b = rng.sample(range(len(fields)), 2)
    fields[a], fields[b] = fields[b], fields[a]
    return "two fields swapped"
  fields.remove(t)
  fields.insert(rng.randint(0, len(fields)), t)
  return "a leaf moved"


def _mutate_text(rng: random.Random, text: str) -> str:
  for _ in range(rng.randint(1, 3)):
    r = rng.random()
    i = rng.randint(0, len(text))
    if r < 0.45:
      text = text[:i] + rng.choice(DTYPE_TOKENS) + text[i:]
    elif r < 0.6 and text:
      text = text[:i] + text[i + rng.randint(1, 3):]
    elif r < 0.75 and text:
      j = rng.randrange(len(text))
      text = text[:j] + rng.choice(DTYPE_TOKENS)[:1] + text[j + 1:]
    elif r < 0.85:
      text = rng.choice(DTYPE_WORDS) + text[i:]
    elif r < 0.92:
      text = f"({rng.choice(('2', '1,', '3,4', '0', '-1', '2.', 'x', '1e9', '2,', ''))})" + text
    else:
      text = text * rng.randint(2, 50)
  return text


def _edit_dtype(rng: random.Random, t: Field, dtypes: list[str]) -> str:
  f = _get(t, 1)
  old = f.value.decode("utf-8", "replace") if f is not None else ""
  r = rng.random()
  if r < 0.3:
    new = rng.choice(dtypes)
  elif r < 0.5:
    new = rng.choice(DTYPE_WORDS)
  elif r < 0.95:
    new = _mutate_text(rng, old)
  else:
    new = "i4," * rng.choice((100, 3000))
  raw = new.encode("utf-8", "surrogatepass")
  if rng.random() < 0.03:
    raw = bytes([0xff, 0xfe]) + raw  # not UTF-8
  if f is None:
    t.value.insert(0, Field(1, varint.LEN, raw))
  else:
    f.value = raw
  return f"dtype {old!r} -> {raw[:60]!r}"


def _edit_shape(rng: random.Random, t: Field, rows: int) -> str:
  at = [i for i, f in enumerate(t.value) if f.number == 2]
  dims = [d for i in at for d in _dims(t.value[i])]
  old = list(dims)
  r = rng.random()
  if r < 0.4 and dims:
    i = rng.randrange(len(dims))
    dims[i] = rng.choice(EDGES + (rows - 1, rows + 1, dims[i] * 2, dims[i] // 2))
  elif r < 0.5:
    dims.insert(rng.randint(0, len(dims)), rng.choice((1, 0, 2, rows) + EDGES))
  elif r < 0.6 and dims:
    del dims[rng.randrange(len(dims))]
  elif r < 0.7:
    dims = [rng.choice((1 << 32, 1 << 21, 3_037_000_500, 1 << 31))] * rng.randint(2, 4)
  elif r < 0.75:
    dims = []
  elif r < 0.8:
    dims = dims * rng.randint(2, 100)
  elif r < 0.9 and dims:  # the element count kept, the dims changed
    dims = [dims[0] * dims[-1]] + dims[1:-1] if len(dims) > 1 else [1, dims[0]]
  else:
    dims = list(reversed(dims))
  layout = rng.random()
  new: list[Field]
  if layout < 0.75:
    new = [Field(2, varint.LEN, _packed(dims))]
    how = "packed"
  elif layout < 0.9:
    new = [Field(2, varint.VARINT, d) for d in dims]
    how = "unpacked"
  else:
    cut = rng.randint(0, len(dims))
    new = [Field(2, varint.LEN, _packed(dims[:cut])), Field(2, varint.LEN, _packed(dims[cut:]))]
    how = "in two packed fields"
  first = at[0] if at else rng.randint(0, len(t.value))
  t.value = [f for f in t.value if f.number != 2]
  t.value[first:first] = new
  return f"shape {old[:6]} -> {dims[:6]}{'...' if len(dims) > 6 else ''} {how}"


def _content(t: Field) -> bytes:
  d = _get(t, 3)
  c = _get(t, 4)
  data = d.value if d is not None else b""
  if c is not None and c.value == wire.COMPRESSION_ZSTD:
    try:  # (a frame declaring its size gets that much allocated: bound it first)
      if zstandard.frame_content_size(data) <= 16 << 20:
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=16 << 20)
    except zstandard.ZstdError:
      pass
  return data


def _set_data(t: Field, data: bytes, codec: int | None) -> None:
  t.value = [f for f in t.value if f.number != 3 and (codec is None or f.number != 4)]
  t.value.append(Field(3, varint.LEN, data))
  if codec:
    t.value.append(Field(4, varint.VARINT, codec))


def _edit_data(rng: random.Random, t: Field, bombs: list[bytes]) -> str:
  raw = _content(t)
  r = rng.random()
  if r < 0.2:
    k = rng.choice((1, 1, 2, 7, len(raw) // 2, len(raw)))
    _set_data(t, raw[:max(0, len(raw) - k)], 0)
    return f"data {k} bytes short"
  if r < 0.3:
    k = rng.choice((1, 1, 8, 4096))
    _set_data(t, raw + bytes(k), 0)
    return f"data {k} bytes long"
  if r < 0.4:
    i = rng.randrange(len(bombs))
    _set_data(t, bombs[i], wire.COMPRESSION_ZSTD)
    return f"data a zstd bomb ({i})"
  if r < 0.85:
    content = raw
    what = ""
    if rng.random() < 0.3:
      k = rng.choice((1, 2, 8, 1000))
      content = raw[:-k] if rng.random() < 0.5 else raw + bytes(k)
      what = f" of {len(content) - len(raw):+d} bytes"
    frame, how = mutate.zstd_frame(rng, content)
    _set_data(t, frame, wire.COMPRESSION_ZSTD)
    return f"data recompressed{what}: {how}"
  # raw data, mislabelled zstd (or the other way round)
  d = _get(t, 3)
  _set_data(t, d.value if d is not None else b"",
            rng.choice((wire.COMPRESSION_ZSTD, 2, 255)))
  return "data's codec changed"


def _edit_codec(rng: random.Random, t: Field) -> str:
  r = rng.random()
  value = rng.choice((0, 1, 1, 2, 3, 255, 1 << 31, 1 << 32, (1 << 64) - 1))
  if r < 0.6:
    t.value = [f for f in t.value if f.number != 4] + [Field(4, varint.VARINT, value)]
    return f"codec {value}"
  if r < 0.8:
    t.value = [f for f in t.value if f.number != 4]
    return "codec field removed"
  t.value.insert(rng.randint(0, len(t.value)), Field(4, varint.VARINT, value))
  return f"a second codec field {value}"


def _unknown(rng: random.Random) -> Field:
  number = rng.choice((5, 6, 9, 15, 16, 2047, (1 << 29) - 1))
  wire_type = rng.choice((0, 1, 2, 5, 3, 4, 6, 7))
  if wire_type == varint.VARINT:
    return Field(number, wire_type, rng.choice(EDGES))
  if wire_type == varint.LEN:
    return Field(number, wire_type, rng.randbytes(rng.choice((0, 1, 9, 300))))
  return Field(number, wire_type, rng.randbytes({1: 8, 5: 4}.get(wire_type, rng.randint(0, 3))))


def _edit_fields(rng: random.Random, fields: list[Field], level: str) -> str:
  r = rng.random()
  if r < 0.5:
    f = _unknown(rng)
    fields.insert(rng.randint(0, len(fields)), f)
    return f"{level}: unknown field {f.number} of wire type {f.wire_type}"
  if r < 0.75 and fields:
    f = copy.deepcopy(rng.choice(fields))
    fields.insert(rng.randint(0, len(fields)), f)
    return f"{level}: field {f.number} repeated"
  if fields:
    rng.shuffle(fields)
  return f"{level}: fields reordered"


def _edit_length(rng: random.Random, fields: list[Field]) -> str:
  lens = [f for f in fields if f.wire_type == varint.LEN]
  for t in _tensors(fields):
    lens += [f for f in t.value if f.wire_type == varint.LEN]
  if not lens:
    return "no length to lie about"
  f = rng.choice(lens)
  n = len(f.value) if isinstance(f.value, bytes) else len(Writer().message(f.value))
  f.length = rng.choice((n - 1, n + 1, 0, n * 2, n + 9) + EDGES)
  if f.length < 0:
    f.length = 0
  return f"field {f.number} says {f.length} bytes for {n}"


def _edit_step(rng: random.Random, fields: list[Field]) -> str:
  fields[:] = [f for f in fields if f.number != 1]
  value = rng.choice(EDGES + (-1, -(1 << 63)))
  fields.insert(0, Field(1, varint.VARINT, value % (1 << 64) if value < 0 else value))
  return f"step {value}"


def _edit_bytes(rng: random.Random, data: bytearray, seeds: list[Seed]) -> str:
  what = []
  for _ in range(rng.randint(1, 4)):
    r = rng.random()
    i = rng.randrange(len(data)) if data else 0
    if r < 0.35 and data:
      data[i] ^= 1 << rng.randrange(8)
      what.append(f"flip@{i}")
    elif r < 0.5 and data:
      data[i] = rng.choice((0, 0x80, 0xFF, rng.randrange(256)))
      what.append(f"set@{i}")
    elif r < 0.6:
      data[i:i] = rng.randbytes(rng.randint(1, 16))
      what.append(f"insert@{i}")
    elif r < 0.7 and data:
      n = rng.randint(1, 16)
      del data[i:i + n]
      what.append(f"delete {n}@{i}")
    elif r < 0.8 and data:
      del data[i:]
      what.append(f"truncate@{i}")
    elif r < 0.9:
      other = rng.choice(seeds).data
      j = rng.randrange(len(other) + 1)
      data[i:] = other[j:]
      what.append(f"splice@{i} from another seed's byte {j}")
    elif data:
      n = rng.randint(1, 64)
      data[i:i] = data[i:i + n]
      what.append(f"repeat {n}@{i}")
  return "bytes: " + ",".join(what)


def mutate_batch(rng: random.Random, seed: Seed, seeds: list[Seed], dtypes: list[str],
                 bombs: list[bytes]) -> tuple[bytes, list[str]]:
  """A mutant of `seed`'s message and the steps that made it."""
  steps: list[str] = []
  r = rng.random()
  if r < 0.8:
    fields = copy.deepcopy(seed.fields)
    rows = seed.expect[0].shape[0] if seed.expect and seed.expect[0].shape else 1
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
      tensors = _tensors(fields)
      k = rng.random()
      if k < 0.1 or not tensors:
        steps.append(_edit_leaves(rng, fields, rng.choice(seeds)))
      elif k < 0.3:
        steps.append(_edit_dtype(rng, rng.choice(tensors), dtypes))
      elif k < 0.5:
        steps.append(_edit_shape(rng, rng.choice(tensors), rows))
      elif k < 0.7:
        steps.append(_edit_data(rng, rng.choice(tensors), bombs))
      elif k < 0.77:
        steps.append(_edit_codec(rng, rng.choice(tensors)))
      elif k < 0.85:
        t = rng.choice(tensors)
        steps.append(_edit_fields(rng, t.value, "Tensor") if rng.random() < 0.6
                     else _edit_fields(rng, fields, "Batch"))
      elif k < 0.93:
        steps.append(_edit_length(rng, fields))
      else:
        steps.append(_edit_step(rng, fields))
    writer = Writer(rng, rng.choice((0.0, 0.0, 0.0, 0.05, 0.3)))
    data = bytearray(writer.message(fields))
    if writer.odd_count:
      steps.append(f"{writer.odd_count} varints written oddly")
  else:
    data = bytearray(seed.data)
  if r >= 0.8 or rng.random() < 0.15:
    steps.append(_edit_bytes(rng, data, seeds))
  return bytes(data), steps


# ---------------------------------------------------------------------------
# Target (a): the client's decoding.

def check_leaves(leaves: list[np.ndarray], expect: tuple[LeafSpec, ...],
                 values: list[bytes] | None) -> list[str]:
  """What is wrong with decoded `leaves`, given the spec (and the values of
  an unmutated seed)."""
  if len(leaves) != len(expect):
    return [f"{len(leaves)} leaves accepted where the spec has {len(expect)}"]
  for i, (a, want) in enumerate(zip(leaves, expect)):
    if not isinstance(a, np.ndarray):
      return [f"leaf {i} ({want.path!r}) is a {type(a).__name__}, not an array"]
    if a.dtype != want.dtype or a.shape != want.shape or a.nbytes != want.nbytes:
      return [f"leaf {i} ({want.path!r}) accepted as {a.dtype}{list(a.shape)} "
              f"({a.nbytes} bytes) where the spec says {want.dtype}{list(want.shape)} "
              f"({want.nbytes} bytes)"]
    if values is not None and a.tobytes() != values[i]:
      return [f"leaf {i} ({want.path!r}) of an unmutated batch decodes to other values"]
  return []


class DecodeTarget:
  """Mutated Batch messages through `transport.decode_step`."""

  name = "decode"

  def __init__(self, fuzzer: "Fuzzer", seeds: list[Seed]):
    self.fuzzer = fuzzer
    self.seeds = seeds
    self.by_name = {s.name: s for s in seeds}
    self.dtypes = sorted({dtypes.dtype_to_str(l.dtype) for s in seeds for l in s.expect})
    self.bombs = [zstd_bomb(2 << 30, declare=True), zstd_bomb(2 << 30, declare=False),
                  zstd_bomb(2 << 30, declare=True, claim=6144),
                  zstd_bomb(64 << 20, declare=False)]
    self.queue = list(seeds)  # the seeds themselves first
    self.stats: collections.Counter = collections.Counter()

  def one(self, rng: random.Random) -> tuple[dict, list[str], list[str]]:
    if self.queue:
      seed = self.queue.pop()
      data, steps, values = seed.data, ["the seed itself"], seed.values
      must_refuse = seed.values is None
    else:
      seed = rng.choice(self.seeds)
      data, steps = mutate_batch(rng, seed, self.seeds, self.dtypes, self.bombs)
      values, must_refuse = None, False
    record = {"target": self.name, "seed": seed.name, "unmutated": steps == ["the seed itself"],
              "data": data}
    self.fuzzer.note(record, steps)
    return record, steps, self.check(seed, data, values, must_refuse)

  def replay(self, record: dict) -> list[str]:
    seed = self.by_name[record["seed"]]
    unmutated = record.get("unmutated", False)
    return self.check(seed, bytes.fromhex(record["data"]),
                      seed.values if unmutated else None, unmutated and seed.values is None)

  def check(self, seed: Seed, data: bytes, values: list[bytes] | None,
            must_refuse: bool) -> list[str]:
    """The decoder itself (`wire.decode_batch_bytes` with the spec's leaves:
    BadBatchError or the leaves), then the client's step decoding (which
    adds the frame limit and the step: BadReplyError or the leaves)."""
    request = pb.BatchRequest(dataset=seed.dataset, start_step=seed.step, num_steps=1)
    limit = frame_limit(seed.expect)
    problems: list[str] = []
    accepted = []
    for how, decode, refusal in (
        ("decoder", lambda: wire.decode_batch_bytes(data, seed.expect), wire.BadBatchError),
        ("client", lambda: transport.decode_step(data, request, 0, limit, seed.expect, "fuzz"),
         transport.BadReplyError)):
      try:
        with self.fuzzer.bounded():
          step, leaves = decode()[:2]
      except refusal as e:
        self.stats[f"{how} refused"] += 1
        self.stats[f"{how} refused: " + _refusal_kind(str(e))] += 1
        continue
      except Hang:
        return [f"hang: the {how} took over {self.fuzzer.args.timeout} s"]
      except MemoryError as e:
        return [f"the {how} allocated past the memory bound: {_escaped(e, 'it')}"]
      except Exception as e:  # pylint: disable=broad-except
        return [_escaped(e, f"the {how}"), traceback.format_exc()[-3000:]]
      self.stats[f"{how} accepted"] += 1
      accepted.append(how)
      if must_refuse and not (how == "decoder" and seed.decoder_may_accept):
        problems.append(f"the {how} accepted a crafted batch that breaks the spec")
      problems += check_leaves(leaves, seed.expect, values)
      if how == "client" and (step != seed.step or "decoder" not in accepted):
        problems.append(f"the client accepted step {step} (the decoder: "
                        f"{'accepted' if 'decoder' in accepted else 'refused'})")
    if values is not None and accepted != ["decoder", "client"]:
      problems.append(f"an unmutated batch was refused (accepted by: {accepted})")
    return problems


def _refusal_kind(details: str) -> str:
  """A refusal's kind, for the outcome counts: its last clause without numbers."""
  tail = details.split(": ")[-1]
  return re.sub(r"'[^']*'|\"[^\"]*\"|\d+", "N", tail)[:50]


# ---------------------------------------------------------------------------
# Target (b): the bulk server's framing, against a model of the protocol.

@dataclasses.dataclass
class Prediction:
  answer: bytes  # what the server sends after MAGIC and its HELLO frame
  greeted: bool  # the peer's magic is right: a HELLO is due
  end: str  # "drop": the server hangs up; "wait": it waits for more; "cap": see CAP_STEPS
  why: str


@dataclasses.dataclass
class Session:
  chunks: list[bytes]
  delays: list[float]  # seconds before each chunk
  ending: str  # "half-close", "close" or "linger"
  steps: list[str]


def _status_frame(e: errors.ElevatorError) -> bytes:
  code, message, type_name = errors.status_of(e)
  return framing.frame(framing.STATUS, pb.BulkStatus(
      code=code.value[0], message=message, error_type=type_name).SerializeToString())


def _frames(data: bytes) -> str:
  """The frames in `data` (after the magic), in words, for a finding."""
  out, pos = [], 4
  while pos + framing.HEADER_SIZE <= len(data) and len(out) < 12:
    kind, size = framing.parse_header(data[pos:pos + framing.HEADER_SIZE])
    out.append(f"{framing.KINDS.get(kind, kind)}({size})")
    pos += framing.HEADER_SIZE + size
  if pos != len(data):
    out.append(f"+{len(data) - pos} bytes")
  return " ".join(out)


class ServerTarget:
  """Sessions of mutated frames against a live `elevator serve`."""

  name = "server"

  def __init__(self, fuzzer: "Fuzzer", config: str, work: str):
    self.fuzzer = fuzzer
    self.config = config
    token_file = os.path.join(work, "token")
    pathlib.Path(token_file).write_text(TOKEN)
    self.server = LocalServer(config, workers=1, extra_args=(
        "--idle-timeout-s", str(IDLE_TIMEOUT_S), "--auth-token-file", token_file,
        "--max-message-bytes", str(MAX_MESSAGE_BYTES)))
    self.address = ("127.0.0.1", self.server.bulk_port)
    # The model's answers: the request path, as embedded mode runs it.
    self.path = RequestPath(registry.Datasets(config_lib.load_config(config),
                                                 open_now=False),
                            auth_token=TOKEN, max_message_bytes=MAX_MESSAGE_BYTES)
    with self.path.admitted(TOKEN) as ticket:
      self.infos = {n: self.path.describe(ticket, pb.DescribeRequest(dataset=n))[0]
                    for n in conftest.DATASETS}
    self.hello = self._learn_hello()
    self.lingering: list[tuple[socket.socket, bytearray, bytes, Prediction, float,
                               dict, list[str]]] = []
    self.log_seen = 0
    self.stats: collections.Counter = collections.Counter()
    self.dead = False

  def _learn_hello(self) -> bytes:
    with socket.create_connection(self.address, timeout=10) as s:
      framing.exchange_magic(s)
      head = bytearray(framing.HEADER_SIZE)
      framing.recv_into(s, memoryview(head))
      kind, size = framing.parse_header(head)
      if kind != framing.HELLO or size > 4096:
        raise HarnessError(f"the server greets with kind {kind}, {size} bytes")
      payload = bytearray(size)
      framing.recv_into(s, memoryview(payload))
      pb.ServerInfo.FromString(bytes(payload))
      return bytes(head + payload)

  # The model --------------------------------------------------------------

  def predict(self, data: bytes) -> Prediction:
    """What the server must answer to `data` (server/serving/bulk.py's read states,
    the request path's answers)."""
    if len(data) < len(framing.MAGIC):
      return Prediction(b"", False, "wait", "greeting incomplete")
    if data[:len(framing.MAGIC)] != framing.MAGIC:
      return Prediction(b"", False, "drop", "not the magic")
    pos, answer, steps = len(framing.MAGIC), bytearray(), 0
    while True:
      if len(data) - pos < framing.HEADER_SIZE:
        return Prediction(bytes(answer), True, "wait",
                          "header incomplete" if len(data) > pos else "input ended")
      kind, size = framing.parse_header(data[pos:pos + framing.HEADER_SIZE])
      if kind != framing.REQUEST:
        return Prediction(bytes(answer), True, "drop", f"frame of kind {kind}")
      if size > MAX_REQUEST_BYTES:
        return Prediction(bytes(answer), True, "drop", f"request of {size} bytes")
      pos += framing.HEADER_SIZE
      if len(data) - pos < size:
        return Prediction(bytes(answer), True, "wait", "request incomplete")
      payload = data[pos:pos + size]
      pos += size
      try:
        message = pb.BulkRequest.FromString(payload)
      except DecodeError:
        return Prediction(bytes(answer), True, "drop", "request not protobuf")
      try:
        self.path.authenticate(message.auth_token or None)
      except errors.ElevatorError as e:
        answer += _status_frame(e)
        continue
      r = message.request
      try:
        for step, leaves in _steps(self.path, r, message.auth_token or None):
          answer += framing.frame(framing.BATCH, wire.encode_batch_bytes(
              step, [np.asarray(a) for a in leaves], r.compression))
          steps += 1
          if steps >= CAP_STEPS or len(answer) >= CAP_BYTES:
            return Prediction(bytes(answer), True, "cap", "a long answer")
      except errors.ElevatorError as e:
        answer += _status_frame(e)

  # Sessions ---------------------------------------------------------------

  def request(self, rng: random.Random) -> pb.BulkRequest:
    """A request a trainer could send (mostly valid)."""
    name = rng.choice(conftest.DATASETS)
    info = self.infos[name]
    g = rng.choice((1, 2, 3, 6, 8, 8, 16, 64, 96))
    n = rng.choice((1, 1, 1, 2, 4))
    h = rng.randrange(n) if rng.random() < 0.95 else n
    total = info.total_steps(g) or 1000
    start = rng.choice((0, rng.randrange(total), total - 1, total - 1, total, total + 3))
    r = pb.BatchRequest(dataset=name, global_batch_size=g, shard_index=h, shard_count=n,
                        start_step=max(0, start), num_steps=rng.choice((1, 1, 2, 3, 0)),
                        compression=rng.choice((0, 0, 1)))
    if rng.random() < 0.3:
      r.config_fingerprint = rng.choice((info.config_fingerprint, "0" * 16))
    if rng.random() < 0.05:
      r.record_offset = rng.choice((1, 7, 999))
    token = rng.choices((TOKEN, "", TOKEN + "x", "x" * 3000), (85, 5, 5, 5))[0]
    return pb.BulkRequest(request=r, auth_token=token)

  def _edit_request(self, rng: random.Random, message: pb.BulkRequest) -> str:
    r = message.request
    name = rng.choice(("global_batch_size", "shard_index", "shard_count", "start_step",
                       "num_steps", "record_offset", "compression", "dataset",
                       "config_fingerprint"))
    if name in ("dataset", "config_fingerprint"):
      value: Any = rng.choice(("", "nope", "plain\x00", "p" * 1000, "\u00e9", "forever"))
    else:
      value = rng.choice(INT64_EDGES)
    try:
      setattr(r, name, value)
    except (ValueError, TypeError):  # out of an int32's range
      value = rng.choice((-1, 0, 1, 2, (1 << 31) - 1, -(1 << 31)))
      setattr(r, name, value)
    return f"request.{name} = {value!r:.40}"

  def payload(self, rng: random.Random, steps: list[str]) -> bytes:
    message = self.request(rng)
    if rng.random() < 0.2:
      steps.append(self._edit_request(rng, message))
    payload = message.SerializeToString()
    r = rng.random()
    if r < 0.08:
      data = bytearray(payload)
      steps.append("payload " + _edit_bytes(rng, data, self.fuzzer.seeds))
      return bytes(data)
    if r < 0.12:  # as long as a frame header (server/serving/bulk.py's explicit read states)
      nine = rng.choice((pb.BulkRequest(request=pb.BatchRequest(dataset="plain")).
                         SerializeToString(), framing.header(framing.REQUEST, 0),
                         framing.header(framing.REQUEST, 9), rng.randbytes(9)))
      steps.append(f"9-byte payload {nine.hex()}")
      return nine
    if r < 0.16:  # about the limit: a valid request padded with an unknown field
      want = MAX_REQUEST_BYTES + rng.choice((-1, 0, 0, 1))
      pad = want - len(payload) - 1 - 3
      padded = payload + b"\x7a" + varint.encode(pad) + bytes(pad)
      steps.append(f"payload padded to {len(padded)} bytes")
      return padded
    if r < 0.18:
      steps.append("random payload")
      return rng.randbytes(rng.choice((1, 5, 40, 300)))
    if r < 0.19:
      steps.append("empty payload")
      return b""
    steps.append(f"request {message.request.dataset!r:.20} G={message.request.global_batch_size} "
                 f"steps {message.request.start_step}+{message.request.num_steps}")
    return payload

  def frame(self, rng: random.Random, steps: list[str]) -> bytes:
    payload = self.payload(rng, steps)
    kind, size = framing.REQUEST, len(payload)
    if rng.random() < 0.05:
      kind = rng.choice((0, framing.HELLO, framing.BATCH, framing.STATUS, 5, 127, 255,
                         rng.randrange(256)))
      steps.append(f"kind {kind}")
    if rng.random() < 0.08:
      size = max(0, rng.choice((size - 1, size + 1, 0, 9, size + 9) + EDGES[:-1]))
      steps.append(f"header says {size} bytes for {len(payload)}")
    return framing.header(kind, size) + payload

  def session(self, rng: random.Random) -> Session:
    steps: list[str] = []
    greeting = framing.MAGIC
    if rng.random() < 0.06:
      greeting = rng.choice((b"", b"GEB", b"GEB2", b"geb1", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
                             framing.header(framing.REQUEST, 4), rng.randbytes(4)))
      steps.append(f"greeting {greeting!r:.40}")
    frames = [self.frame(rng, steps) for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4)))]
    data = greeting + b"".join(frames)
    if rng.random() < 0.04:
      data += rng.randbytes(rng.randint(1, 20))
      steps.append("trailing garbage")
    bounds, at = [], len(greeting)
    for f in frames:
      bounds += [at, at + framing.HEADER_SIZE]
      at += len(f)
    cuts = set()
    for _ in range(rng.choice((0, 0, 1, 2, 3, 6))):
      base = rng.choice(bounds) if bounds and rng.random() < 0.7 else rng.randrange(len(data) + 1)
      cuts.add(min(len(data), max(0, base + rng.randint(-2, 2))))
    edges = [0, *sorted(cuts - {0, len(data)}), len(data)]
    chunks = [data[a:b] for a, b in zip(edges, edges[1:])]
    slow = rng.random() < 0.15
    delays = [0.0] + [rng.uniform(0.001, 0.02) if slow else 0.0 for _ in chunks[1:]]
    if len(chunks) > 1:
      steps.append(f"sent in {len(chunks)} pieces{' with pauses' if slow else ''}")
    ending = rng.choices(("half-close", "close", "linger"), (80, 10, 10))[0]
    return Session(chunks, delays, ending, steps)

  def one(self, rng: random.Random) -> tuple[dict, list[str], list[str]]:
    s = self.session(rng)
    record = {"target": self.name, "chunks": s.chunks, "delays": s.delays, "ending": s.ending}
    self.fuzzer.note(record, s.steps)
    return record, s.steps, self.run(s, record, s.steps)

  def replay(self, record: dict) -> list[str]:
    s = Session([bytes.fromhex(c) for c in record["chunks"]], record["delays"],
                "half-close" if record["ending"] == "linger" else record["ending"], [])
    return self.run(s, record, [])

  def run(self, s: Session, record: dict, steps: list[str]) -> list[str]:
    if self.dead:
      return []
    data = b"".join(s.chunks)
    pred = self.predict(data)
    self.stats[f"model: {pred.end}"] += 1
    self.stats[f"model: {pred.why}"] += 1
    try:
      sock = socket.create_connection(self.address, timeout=10)
    except OSError as e:
      return [f"the server's bulk port refused a connection: {e}"] + self._liveness()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    got = bytearray()
    closed = ""
    problems: list[str] = []
    try:
      for chunk, delay in zip(s.chunks, s.delays):
        if delay:
          closed = closed or self._pump(sock, got, time.monotonic() + delay)
        closed = closed or self._send(sock, chunk, got)
        if closed:
          break
      expected = framing.MAGIC + (self.hello if pred.greeted else b"") + pred.answer
      if closed and pred.end != "drop" and not (pred.end == "cap" and
                                                 len(got) >= len(expected)):
        problems.append(f"the server hung up while it was sent a valid session "
                        f"({pred.why}): {closed}")
      elif pred.end == "cap":
        self._read(sock, got, until=len(expected), seconds=30)
        if got[:len(expected)] != expected:
          problems += self._differs(got, expected, pred, "")
      elif s.ending == "close":
        self.stats["closed by us"] += 1
      elif (s.ending == "linger" and pred.end == "wait" and not closed and
            len(self.lingering) < 64 and len(expected) <= 256 << 10 and
            (deadline := time.monotonic() + (IDLE_TIMEOUT_S if pred.greeted else
                                             HANDSHAKE_TIMEOUT_S) + 5) < self.fuzzer.end_at):
        # (A short answer, which the socket's buffers hold until it is polled;
        # a deadline within the run, so that the run need not wait for it.)
        self.lingering.append((sock, got, expected, pred, deadline, record, steps))
        sock = None
      else:
        if not closed:
          try:
            sock.shutdown(socket.SHUT_WR)
          except OSError:
            closed = "reset"
        # (Generous: a step of MAX_MESSAGE_BYTES takes seconds on a loaded machine.)
        closed = closed or self._read(sock, got, until=None, seconds=30 + len(expected) / 1e6)
        problems += self._verdict(got, expected, pred, closed, "after a half-close")
    finally:
      if sock is not None:
        sock.close()
    return problems + self._liveness()

  def _verdict(self, got: bytearray, expected: bytes, pred: Prediction, closed: str,
               when: str) -> list[str]:
    self.stats[f"answer {closed or 'open'}"] += 1
    if not closed:
      return [f"connection neither answered nor closed {when} ({pred.why}; got "
              f"{_frames(bytes(got))}, expected {_frames(expected)})"]
    ok = expected.startswith(bytes(got)) if pred.end == "drop" else bytes(got) == expected
    return [] if ok else self._differs(got, expected, pred, when)

  def _differs(self, got: bytearray, expected: bytes, pred: Prediction, when: str) -> list[str]:
    at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
              min(len(got), len(expected)))
    return [f"the answer differs from the model's {when} at byte {at} ({pred.end}: "
            f"{pred.why}): got {len(got)} bytes [{_frames(bytes(got))}], expected "
            f"{len(expected)} [{_frames(expected)}]"]

  @staticmethod
  def _recv(sock: socket.socket, got: bytearray) -> str:
    """Reads what is there; "eof" or "reset" once the server hung up."""
    while True:
      try:
        chunk = sock.recv(1 << 20)
      except (BlockingIOError, InterruptedError):
        return ""
      except OSError:
        return "reset"
      if not chunk:
        return "eof"
      got += chunk

  def _pump(self, sock: socket.socket, got: bytearray, until: float) -> str:
    while (left := until - time.monotonic()) > 0:
      ready, _, _ = select.select([sock], [], [], left)
      if ready and (closed := self._recv(sock, got)):
        return closed
    return ""

  def _send(self, sock: socket.socket, data: bytes, got: bytearray) -> str:
    """Sends `data`, reading meanwhile; "" if all went, else why not."""
    view = memoryview(data)
    while view:
      readable, writable, _ = select.select([sock], [sock], [], 10)
      if readable and (closed := self._recv(sock, got)):
        return closed
      if writable:
        try:
          view = view[sock.send(view):]
        except (BlockingIOError, InterruptedError):
          pass
        except OSError:
          return "reset"
      elif not readable:
        return "stuck: the server read nothing for 10 s"
    return ""

  def _read(self, sock: socket.socket, got: bytearray, until: int | None,
            seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while until is None or len(got) < until:
      left = deadline - time.monotonic()
      if left <= 0:
        return ""
      ready, _, _ = select.select([sock], [], [], left)
      if ready and (closed := self._recv(sock, got)):
        return closed
    return ""

  def poll_lingering(self) -> list[tuple[dict, list[str], list[str]]]:
    """Connections left quiet on purpose: each must be closed by the server's
    timeouts. Returns (record, steps, problems) of those that ended badly."""
    out, keep, now = [], [], time.monotonic()
    for item in self.lingering:
      sock, got, expected, pred, deadline, record, steps = item
      closed = self._recv(sock, got)
      if closed or now > deadline:
        sock.close()
        problems = self._verdict(got, expected, pred, closed, "by its timeouts")
        self.stats["lingered"] += 1
        if problems:
          out.append((record, steps, problems))
      else:
        keep.append(item)
    self.lingering = keep
    return out

  def _liveness(self) -> list[str]:
    problems = []
    log = self.server.stderr()
    new, self.log_seen = log[self.log_seen:], len(log)
    for needle in ("Traceback", "restarting it"):
      if needle in new:
        at = new.index(needle)
        problems.append(f"the server logged {needle!r}: {new[max(0, at - 200):at + 2500]}")
    if not self.dead and self.server.proc.poll() is not None:
      self.dead = True
      problems.append(f"the server exited ({self.server.proc.returncode}): {log[-3000:]}")
    return problems

  def clean_answers(self) -> list[Seed]:
    """A live server's answers to clean requests, checked against the model
    (a disagreement here is the model's or the server's, before any mutant),
    as seeds for the decode target."""
    out = []
    for name, g, compression in (("plain", 128, 1), ("eval", 96, 1), ("raw", 64, 0),
                                 ("seed3", 64, 1), ("aug2", 8, 0)):
      info = self.infos[name]
      last = info.total_steps(g) - 1
      request = pb.BatchRequest(dataset=name, global_batch_size=g, shard_count=1,
                                start_step=last - 1, num_steps=2, compression=compression)
      data = framing.MAGIC + framing.frame(framing.REQUEST, pb.BulkRequest(
          request=request, auth_token=TOKEN).SerializeToString())
      problems = self.run(Session([data], [0.0], "half-close", []), {}, [])
      if problems:
        raise HarnessError(f"a clean request for {name!r} G={g}: {problems}")
      # The same again, to read the answer's batches out of it.
      with socket.create_connection(self.address, timeout=10) as s:
        s.sendall(data)
        magic = bytearray(len(framing.MAGIC))
        framing.recv_into(s, memoryview(magic))
        framing.recv_frame(s, (framing.HELLO,), 4096)
        expect = info.element_spec.batch_leaves(g)
        leaves = list(_steps(self.path, request, TOKEN))
        for step, values in leaves:
          _, payload = framing.recv_frame(s, (framing.BATCH,), 64 << 20)
          message = payload.tobytes()
          out.append(Seed(f"server: {name} G={g} step {step}", name, expect, step, message,
                          _values([np.asarray(a) for a in values]), parse(message)))
    return out

  def finish(self) -> list[str]:
    """The server after it all: alive, no traceback, exact streams, a clean exit."""
    problems = self._liveness()
    if self.dead:
      return problems
    security = Security(auth_token=TOKEN)
    for name, g, options in (("plain", 64, TransportOptions()),
                             ("eval", 96, TransportOptions(kind="bulk", compression="zstd")),
                             ("seed3", 64, TransportOptions(kind="grpc"))):
      try:
        with RemoteDataset(self.server.target, name, g, transport=options,
                           security=security) as ds:
          with RemoteDataset.embedded(self.config, name, g) as local:
            assert_streams_equal(ds, local)
      except Exception as e:  # pylint: disable=broad-except
        problems.append(f"after the run, {name} over {options.kind} does not read the exact "
                        f"stream: {_escaped(e, 'RemoteDataset')}")
    code = self.server.stop()
    if code != 0:
      problems.append(f"the server exited {code} when stopped: {self.server.stderr()[-3000:]}")
    self.dead = True  # stopped: only its log is checked from here
    return problems + self._liveness()

  def close(self) -> None:
    for item in self.lingering:
      item[0].close()
    self.server.stop()


# ---------------------------------------------------------------------------
# Target (c): the bulk client's framing, against a fake server.

@dataclasses.dataclass
class Script:
  greeting: bytes  # magic and HELLO, sent at once
  body: bytes  # sent once the client's request arrived
  ending: str  # "close", "reset", "wait" or "stall" (half the body, then silence)


class FakeServer:
  """A bulk server in a thread that plays one script per connection."""

  def __init__(self):
    self.listener = socket.create_server(("127.0.0.1", 0))
    self.listener.settimeout(5)
    self.port = self.listener.getsockname()[1]
    self.jobs: queue.SimpleQueue = queue.SimpleQueue()
    self.done: queue.SimpleQueue = queue.SimpleQueue()
    self.thread = threading.Thread(target=self._loop, name="fuzz-fake-bulk", daemon=True)
    self.thread.start()

  def _loop(self) -> None:
    while True:
      script = self.jobs.get()
      if script is None:
        return
      try:
        self._play(script)
      except Exception:  # pylint: disable=broad-except
        pass  # the client's side is what is checked
      self.done.put(True)

  def _play(self, script: Script) -> None:
    conn, _ = self.listener.accept()
    with conn:
      conn.settimeout(8)  # waits on the client: as long as it may take with a true stream
      try:
        conn.sendall(script.greeting)
        got = bytearray()

        def fill(n: int) -> bool:
          while len(got) < n:
            chunk = conn.recv(65536)
            if not chunk:
              return False
            got.extend(chunk)
          return True

        head = len(framing.MAGIC) + framing.HEADER_SIZE  # the client's magic and request
        if not fill(head) or not fill(head + framing.parse_header(got[4:head])[1]):
          return
        if script.ending == "stall":
          conn.sendall(script.body[:len(script.body) // 2])
        else:
          conn.sendall(script.body)
        if script.ending == "reset":
          conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        elif script.ending in ("wait", "stall"):
          while conn.recv(65536):  # until the client hangs up
            pass
      except OSError:
        return

  def close(self) -> None:
    self.jobs.put(None)
    self.listener.close()


class ClientTarget:
  """Mutated answers of a fake bulk server to client/transport/bulk_connection.py's BulkConnection."""

  name = "client"

  def __init__(self, fuzzer: "Fuzzer", streams: list[Stream]):
    self.fuzzer = fuzzer
    self.streams = streams
    self.by_name = {s.name: s for s in streams}
    self.fake = FakeServer()
    self.hello = framing.frame(framing.HELLO, pb.ServerInfo(
        worker_index=0, num_workers=1, bulk_port=self.fake.port).SerializeToString())
    self.queue = list(streams)
    self.stats: collections.Counter = collections.Counter()

  def _frame(self, rng: random.Random, kind: int, payload: bytes, limit: int,
             steps: list[str], what: str) -> bytes:
    size = len(payload)
    r = rng.random()
    if r < 0.06:
      kind = rng.choice((0, framing.HELLO, framing.REQUEST, framing.BATCH, framing.STATUS,
                         5, 255))
      steps.append(f"{what}: kind {kind}")
    elif r < 0.12:
      size = max(0, rng.choice((size - 1, size + 1, limit, limit + 1, (1 << 20) + 1,
                                1 << 31, (1 << 63) - 1, (1 << 64) - 1)))
      steps.append(f"{what}: header says {size} bytes for {len(payload)}")
    return framing.header(kind, size) + payload

  def script(self, rng: random.Random, stream: Stream, steps: list[str]) -> Script:
    limit = max(stream.limit, 1 << 20)
    greeting = framing.MAGIC
    if rng.random() < 0.04:
      greeting = rng.choice((b"", b"GEB2", b"GEB", rng.randbytes(4)))
      steps.append(f"magic {greeting!r}")
    hello = pb.ServerInfo(worker_index=0, num_workers=1, bulk_port=self.fake.port)
    hello_bytes = hello.SerializeToString()
    if rng.random() < 0.06:
      data = bytearray(hello_bytes)
      steps.append("hello " + _edit_bytes(rng, data, self.fuzzer.seeds))
      hello_bytes = bytes(data)
    greeting += self._frame(rng, framing.HELLO, hello_bytes, 1 << 20, steps, "hello")
    frames = []
    for seed in stream.seeds:
      payload = seed.data
      if rng.random() < 0.35:
        payload, how = mutate_batch(rng, seed, self.fuzzer.seeds, self.fuzzer.decode.dtypes,
                                    self.fuzzer.decode.bombs)
        steps.append(f"step {seed.step}: " + "; ".join(how))
      frames.append(self._frame(rng, framing.BATCH, payload, stream.limit, steps,
                                f"step {seed.step}"))
    r = rng.random()
    if r < 0.1:
      code = rng.choice((0, 1, 4, 5, 8, 11, 14, 15, 16, 17, 99, -1, (1 << 31) - 1))
      status = pb.BulkStatus(code=code, message=rng.choice(("", "x" * 100, "\u00e9")),
                             error_type=rng.choice(("", "DataLossError", "NotAnError",
                                                    "InternalError")))
      payload = status.SerializeToString()
      if rng.random() < 0.3:
        payload = rng.randbytes(rng.randint(0, 40))
      frames.insert(rng.randint(0, len(frames)),
                    self._frame(rng, framing.STATUS, payload, limit, steps, "status"))
      steps.append(f"a status frame (code {code})")
    elif r < 0.15 and frames:
      i = rng.randrange(len(frames))
      frames.insert(i, frames[i])
      steps.append(f"frame {i} twice")
    elif r < 0.2 and frames:
      del frames[rng.randrange(len(frames))]
      steps.append("a frame left out")
    elif r < 0.23 and len(frames) > 1:
      frames.reverse()
      steps.append("frames reversed")
    body = b"".join(frames)
    if rng.random() < 0.08 and body:
      cut = rng.randrange(len(body))
      body = body[:cut]
      steps.append(f"answer cut at byte {cut}")
    ending = rng.choices(("close", "reset", "wait", "stall"), (60, 15, 22, 3))[0]
    steps.append(f"then {ending}")
    return Script(greeting, body, ending)

  def one(self, rng: random.Random) -> tuple[dict, list[str], list[str]]:
    steps: list[str] = []
    if self.queue:
      stream = self.queue.pop()
      script = Script(framing.MAGIC + self.hello, b"".join(
          framing.frame(framing.BATCH, s.data) for s in stream.seeds), "close")
      steps.append("the stream itself")
    else:
      stream = rng.choice(self.streams)
      script = self.script(rng, stream, steps)
    record = {"target": self.name, "stream": stream.name, "greeting": script.greeting,
              "body": script.body, "ending": script.ending,
              "unmutated": steps == ["the stream itself"]}
    self.fuzzer.note(record, steps)
    return record, steps, self.check(stream, script, record["unmutated"])

  def replay(self, record: dict) -> list[str]:
    script = Script(bytes.fromhex(record["greeting"]), bytes.fromhex(record["body"]),
                    record["ending"])
    return self.check(self.by_name[record["stream"]], script, record.get("unmutated", False))

  def check(self, stream: Stream, script: Script, unmutated: bool) -> list[str]:
    self.fake.jobs.put(script)
    problems: list[str] = []
    got: list[tuple[int, list[np.ndarray]]] = []
    try:
      with self.fuzzer.bounded():
        conn = BulkConnection("fuzz", "127.0.0.1", self.fake.port, connect_timeout_s=2,
                              auth_token=TOKEN)
        try:
          # Mutants that stall cost their timeout; true streams get time to
          # spare on a loaded machine (under --timeout, which would be a hang).
          for item in conn.stream(stream.request, timeout_s=8 if unmutated else 0.3,
                                  token=transport.CancelToken(),
                                  max_frame_bytes=stream.limit, expect=stream.expect):
            got.append(item)
        finally:
          conn.close()
    except transport.TransportError as e:
      kind = "bad reply" if isinstance(e, transport.BadReplyError) else e.code.name
      self.stats[f"refused: {kind}"] += 1
      if unmutated:
        problems.append(f"a true stream was refused: {e}")
    except Hang:
      problems.append(f"hang: the client took over {self.fuzzer.args.timeout} s")
    except MemoryError as e:
      problems.append(f"the bulk client allocated past the memory bound: {_escaped(e, 'it')}")
    except Exception as e:  # pylint: disable=broad-except
      problems += [_escaped(e, "the bulk client"), traceback.format_exc()[-3000:]]
    else:
      self.stats["accepted"] += 1
      if len(got) != stream.request.num_steps:
        problems.append(f"{len(got)} steps yielded for a request of "
                        f"{stream.request.num_steps}, without an error")
    for (step, leaves, _, _), seed in zip(got, stream.seeds):
      if step != seed.step:
        problems.append(f"step {step} yielded as step {seed.step}")
      problems += check_leaves(leaves, stream.expect, seed.values if unmutated else None)
    try:
      self.fake.done.get(timeout=30)
    except queue.Empty as e:
      raise HarnessError("the fake server did not finish its script in 30 s") from e
    return problems


# ---------------------------------------------------------------------------
# The campaign.

def jsonable(value: Any) -> Any:
  """A record as saved: bytes as hex (the targets' `replay` reads them back)."""
  if isinstance(value, (bytes, bytearray)):
    return bytes(value).hex()
  if isinstance(value, (list, tuple)):
    return [jsonable(v) for v in value]
  if isinstance(value, dict):
    return {k: jsonable(v) for k, v in value.items()}
  return value


class CrashNote:
  """The input in flight, kept in a shared file mapping: a memory copy per
  input, no system call, and still on disk when the process dies of a
  signal (a crash in native code), for the supervisor to save."""

  SIZE = 64 << 20
  _LENGTH = struct.Struct("<Q")

  def __init__(self, path: str):
    with open(path, "w+b") as f:
      f.truncate(self.SIZE)
      self._map = mmap.mmap(f.fileno(), self.SIZE)

  def note(self, record: dict, steps: list[str]) -> None:
    blob = pickle.dumps((record, steps), protocol=5)
    if len(blob) > self.SIZE - self._LENGTH.size:
      blob = pickle.dumps(({k: v for k, v in record.items() if not isinstance(v, bytes)},
                           steps + ["(input too long to keep)"]), protocol=5)
    self._map[:self._LENGTH.size] = self._LENGTH.pack(0)
    self._map[self._LENGTH.size:self._LENGTH.size + len(blob)] = blob
    self._map[:self._LENGTH.size] = self._LENGTH.pack(len(blob))

  @classmethod
  def read(cls, path: str) -> tuple[dict, list[str]] | None:
    try:
      with open(path, "rb") as f:
        n = cls._LENGTH.unpack(f.read(cls._LENGTH.size))[0]
        return pickle.loads(f.read(n)) if n else None  # our own file
    except (OSError, struct.error, pickle.UnpicklingError, EOFError):
      return None

def signature(target: str, problems: list[str]) -> str:
  """A finding's kind, for counting repeats: its first problem up to its
  first colon (an escaped exception: its type and where), without numbers."""
  return f"{target}: {re.sub(r'[0-9]+', 'N', problems[0].split(': ')[0])}"[:90]


class Fuzzer:
  """Sets the targets up, gives them turns, keeps findings."""

  def __init__(self, args: argparse.Namespace, work: str):
    self.args, self.work = args, work
    self.out = os.path.abspath(args.out)
    self.findings = 0
    self.kinds: collections.Counter = collections.Counter()
    self.memory_limit: tuple[int, int] | None = None
    self.end_at = float("inf")  # when the campaign's time is up
    self.crash_note: CrashNote | None = None
    self.rss_before = 0.0

  def setup(self) -> None:
    logging.getLogger("grain_elevator").addHandler(logging.NullHandler())
    logging.getLogger("grain_elevator").propagate = False  # the model's refusals
    signal.signal(signal.SIGALRM, _on_alarm)
    data = pathlib.Path(self.work) / "data"
    examples.write_image_shards(str(data / "shards"), num_records=conftest.NUM_RECORDS,
                                num_shards=3, **conftest.IMAGE)
    (data / "elevator.toml").write_text(conftest.CONFIG)
    config = str(data / "elevator.toml")
    targets = self.args.targets.split(",")
    path = RequestPath(registry.Datasets(config_lib.load_config(config), open_now=False))
    streams = real_streams(path) + synthetic_streams(random.Random(0))
    seeds = [s for st in streams for s in st.seeds]
    plain = next(s for s in seeds if s.name == "plain G=128 0/1 step 0 raw")
    evals = next(s for s in seeds if s.name.startswith("eval G=96") and "raw" in s.name)
    seeds += crafted_seeds(plain, evals)
    self.seeds = seeds
    self.server = None
    if "server" in targets:
      self.server = ServerTarget(self, config, self.work)
      seeds += self.server.clean_answers()
    self.decode = DecodeTarget(self, seeds)
    self.client = ClientTarget(self, streams) if "client" in targets else None
    self.targets = [t for t in (self.decode, self.server, self.client)
                    if t is not None and t.name in targets]
    print(f"{PREFIX} {len(seeds)} seed batches ({sum(s.values is None for s in seeds)} crafted), "
          f"{len(streams)} streams, {len(DTYPE_WORDS)} dtype words; server "
          f"{self.server.server.target if self.server else 'off'}", flush=True)
    # From here on, this process may not grow by more than --memory-mb.
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size() + (self.args.memory_mb << 20)
    if hard != resource.RLIM_INFINITY:
      limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    self.memory_limit = (soft, hard)
    self.rss_before = _peak_rss_mb()

  def unbound_memory(self) -> None:
    if self.memory_limit is not None:
      resource.setrlimit(resource.RLIMIT_AS, self.memory_limit)
      self.memory_limit = None

  class _Bounded:
    def __init__(self, fuzzer: "Fuzzer"):
      self.fuzzer = fuzzer

    def __enter__(self):
      self.rss = _peak_rss_mb()
      signal.setitimer(signal.ITIMER_REAL, self.fuzzer.args.timeout)

    def __exit__(self, *exc):
      signal.setitimer(signal.ITIMER_REAL, 0)
      grew = _peak_rss_mb() - self.rss
      if grew > self.fuzzer.args.rss_jump_mb:  # refused or not
        raise MemoryError(f"peak RSS grew by {grew:.0f} MiB on one input")
      return False

  def bounded(self) -> "Fuzzer._Bounded":
    """Around one input: a SIGALRM at --timeout, and peak RSS may not grow
    by more than --rss-jump-mb (a MemoryError if it did)."""
    return Fuzzer._Bounded(self)

  def note(self, record: dict, steps: list[str]) -> None:
    """The input about to run, for the supervisor should this process die."""
    if self.crash_note is not None:
      self.crash_note.note(record, steps)

  def save(self, target: str, record: dict, steps: list[str], problems: list[str]) -> None:
    self.findings += 1
    save_finding(self.out, self.findings, self.kinds, self.args.keep, target, record, steps,
                 problems)

  def write_state(self, counts: collections.Counter, spent: dict[str, float],
                  seconds: float) -> None:
    """What the supervisor adds up (written at each report, so that a run
    that dies still counts)."""
    if not self.args.state:
      return
    state = {"findings": self.findings, "kinds": dict(self.kinds), "counts": dict(counts),
             "spent": spent, "seconds": seconds, "rss_before": self.rss_before,
             "peak_rss": _peak_rss_mb(),
             "stats": {t.name: dict(t.stats.most_common(24)) for t in self.targets}}
    with open(self.args.state + ".tmp", "w") as f:
      json.dump(state, f)
    os.replace(self.args.state + ".tmp", self.args.state)

  def run(self) -> int:
    master = random.Random(self.args.seed)
    print(f"{PREFIX} seed {self.args.seed}, {self.args.seconds:.0f} s, targets "
          f"{', '.join(t.name for t in self.targets)}, findings to {self.out}", flush=True)
    spent = {t.name: 0.0 for t in self.targets}
    counts: collections.Counter = collections.Counter()
    start = last = time.monotonic()
    self.end_at = start + self.args.seconds
    while True:
      now = time.monotonic()
      if now - start >= self.args.seconds and not any(
          getattr(t, "queue", None) for t in self.targets):
        break
      target = min(self.targets, key=lambda t: spent[t.name])
      for _ in range(20 if target is self.decode else 1):
        rng = random.Random(master.getrandbits(63))
        began = time.monotonic()
        record, steps, problems = target.one(rng)
        spent[target.name] += time.monotonic() - began
        counts[target.name] += 1
        if problems:
          self.save(target.name, record, steps, problems)
      if self.server in self.targets and self.server.lingering:
        for record, steps, problems in self.server.poll_lingering():
          self.save("server", record, steps, problems)
      if now - last >= self.args.progress:
        last = now
        print(f"{PREFIX} {now - start:6.0f} s  " + ", ".join(
            f"{t.name} {counts[t.name]}" for t in self.targets) +
              f" inputs  {self.findings} findings  peak RSS {_peak_rss_mb():.0f} MiB",
              flush=True)
        self.write_state(counts, spent, now - start)
    self.unbound_memory()
    if self.server in self.targets:
      self.note({"target": "server", "after": "the run"}, [])
      deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S + 10
      while self.server.lingering and time.monotonic() < deadline:
        time.sleep(0.2)
        for record, steps, problems in self.server.poll_lingering():
          self.save("server", record, steps, problems)
      problems = self.server.finish()
      if problems:
        self.save("server", {"target": "server", "after": "the run"}, [], problems)
    self.write_state(counts, spent, time.monotonic() - start)
    for t in self.targets:
      print(f"{PREFIX} {t.name} outcomes: {dict(t.stats.most_common(24))}", flush=True)
    return 1 if self.findings else 0

  def replay(self, path: str) -> int:
    record = json.load(open(path))
    target = {t.name: t for t in self.targets}.get(record["target"])
    if target is None:
      raise HarnessError(f"{path}: target {record['target']!r} is not set up (--targets)")
    problems = target.replay(record)
    print("problems:" if problems else "no problems", *problems, sep="\n  ")
    return 1 if problems else 0

  def close(self) -> None:
    self.unbound_memory()
    server = getattr(self, "server", None)
    if server is not None and server.server.proc.poll() is None:
      server.close()
    if getattr(self, "client", None) is not None:
      self.client.fake.close()


def save_finding(out: str, number: int, kinds: collections.Counter, keep: int, target: str,
                 record: dict, steps: list[str], problems: list[str]) -> None:
  """Counts finding `number` in `kinds`; prints and saves the first `keep`
  of each kind (the summary gives the count of the rest)."""
  kind = signature(target, problems)
  kinds[kind] += 1
  if kinds[kind] > keep:
    return
  print(f"FINDING {number} ({target} {record.get('seed') or record.get('stream') or ''}): "
        f"{problems[0][:600]}", flush=True)
  for s in steps[:12]:
    print(f"    {s}", flush=True)
  os.makedirs(out, exist_ok=True)
  name = os.path.join(out, f"wire-{number:04d}-"
                      f"{re.sub(r'[^a-z]+', '-', kind.lower())[:50].strip('-')}")
  with open(name + ".json", "w") as f:
    json.dump({**jsonable(record), "steps": steps, "problems": problems}, f, indent=1)
  if isinstance(record.get("data"), bytes):
    with open(name + ".bin", "wb") as f:
      f.write(record["data"])
  print(f"    saved {name}.json", flush=True)


def supervise(args: argparse.Namespace) -> int:
  """Runs the campaign in a child process, restarted after a crash (a
  signal: native code died on an input) with the time left; each crash is
  a finding, saved with the input the child noted before running it. Adds
  up the children's counts and prints the summary."""
  out = os.path.abspath(args.out)
  passed = []  # the options a child takes as given
  for name in ("out", "targets", "timeout", "memory_mb", "rss_jump_mb", "keep", "progress"):
    passed += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
  deadline = time.monotonic() + args.seconds
  started = time.monotonic()
  findings, kinds = 0, collections.Counter()
  counts: collections.Counter = collections.Counter()
  spent: collections.Counter = collections.Counter()
  stats: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  rss_before, peak_rss, crashes = 0.0, 0.0, 0
  with tempfile.TemporaryDirectory(prefix="fuzz-wire-") as base:
    for run in itertools.count(1):
      work = os.path.join(base, f"run-{run}")
      os.makedirs(work)
      state = os.path.join(base, f"state-{run}.json")
      note = os.path.join(base, f"input-{run}")
      stack = os.path.join(base, f"traceback-{run}.txt")
      with open(state, "w") as f:
        json.dump({"findings": findings, "kinds": dict(kinds)}, f)
      child = subprocess.Popen(
          [sys.executable, os.path.abspath(__file__), *passed, "--child", "--work", work,
           "--state", state, "--crash-note", note, "--traceback-file", stack,
           "--seconds", str(max(0.0, deadline - time.monotonic())),
           "--seed", str(args.seed + run - 1)],
          start_new_session=True)  # its group: the server it started goes with it
      try:
        code = child.wait(timeout=max(0.0, deadline - time.monotonic()) + 600)
      except subprocess.TimeoutExpired:
        code = -signal.SIGKILL  # a hang outside any input's alarm: as a crash
        print(f"{PREFIX} the fuzzing process has hung; killing it", flush=True)
      try:
        os.killpg(child.pid, signal.SIGKILL)  # anything of its own left behind
      except (ProcessLookupError, PermissionError):
        pass
      with open(state) as f:
        done = json.load(f)
      findings, kinds = done["findings"], collections.Counter(done["kinds"])
      counts.update(done.get("counts", {}))
      spent.update(done.get("spent", {}))
      for name, outcomes in done.get("stats", {}).items():
        stats[name].update(outcomes)
      rss_before = rss_before or done.get("rss_before", 0.0)
      peak_rss = max(peak_rss, done.get("peak_rss", 0.0))
      if code >= 0:
        if code != (1 if findings else 0):
          raise HarnessError(f"the fuzzing process exited {code} ({findings} findings)")
        break
      crashes += 1
      findings += 1
      why = f"the process was killed by {signal.Signals(-code).name}"
      noted = CrashNote.read(note)
      record, steps = noted if noted else ({"target": "?"}, ["(no input noted)"])
      with open(stack, errors="replace") as f:
        where = f.read()[-3000:]
      save_finding(out, findings, kinds, args.keep, record.get("target", "?"), record, steps,
                   [f"{why} running this input", where])
      if noted is None or deadline - time.monotonic() < 15:
        break  # a crash outside any input would come again; or no time for a start
      print(f"{PREFIX} restarting after the crash, {deadline - time.monotonic():.0f} s left",
            flush=True)
  seconds = time.monotonic() - started
  for name, outcomes in stats.items():
    if crashes:  # (each run printed its own; these are the sums)
      print(f"{PREFIX} {name} outcomes, all runs: {dict(outcomes.most_common(24))}")
  for kind, n in kinds.most_common():
    print(f"{PREFIX} {n:6d} x {kind}")
  for name in args.targets.split(","):
    n = sum(v for k, v in kinds.items() if k.startswith(name + ":"))
    print(f"{PREFIX} {name}: {counts[name]} inputs, {n} findings, {spent[name]:.0f} s")
  print(f"{PREFIX} peak RSS {rss_before:.0f} MiB after setting up, {peak_rss:.0f} MiB at the "
        f"end; {crashes} crashes (restarts)")
  print(f"{PREFIX} {sum(counts.values())} inputs in {seconds:.0f} s, {findings} findings",
        flush=True)
  return 1 if findings else 0


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seconds", type=float, default=60, help="how long to fuzz")
  parser.add_argument("--seed", type=int, default=None, help="random seed (default: time)")
  parser.add_argument("--out", default="fuzz-findings", help="folder for findings")
  parser.add_argument("--targets", default="decode,server,client",
                      help="which targets take turns (comma-separated)")
  parser.add_argument("--timeout", type=float, default=10,
                      help="seconds one decode or client session may take (else: a hang)")
  parser.add_argument("--memory-mb", type=int, default=1024,
                      help="address space this process may add after setting up")
  parser.add_argument("--rss-jump-mb", type=int, default=64,
                      help="growth of peak RSS one input may cause")
  parser.add_argument("--keep", type=int, default=3, help="inputs saved per kind of finding")
  parser.add_argument("--progress", type=float, default=10, help="seconds between reports")
  parser.add_argument("--replay", help="check one saved finding (a wire-*.json) again")
  # The supervisor's child (supervise): where it works and what it leaves.
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--work", help=argparse.SUPPRESS)
  parser.add_argument("--state", help=argparse.SUPPRESS)
  parser.add_argument("--crash-note", help=argparse.SUPPRESS)
  parser.add_argument("--traceback-file", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.seed is None:
    args.seed = int(time.time())
  if args.replay:  # only what the finding needs (a server's answers need the server)
    record = json.load(open(args.replay))
    args.targets = record["target"] + (",server" if str(record.get("seed")).startswith(
        "server:") else "")
  elif not args.child:
    return supervise(args)
  with contextlib.ExitStack() as stack:
    work = args.work or stack.enter_context(tempfile.TemporaryDirectory(prefix="fuzz-wire-"))
    if args.traceback_file:
      faulthandler.enable(stack.enter_context(open(args.traceback_file, "w")),
                          all_threads=True)
    fuzzer = Fuzzer(args, work)
    stack.callback(fuzzer.close)
    if args.state:
      with open(args.state) as f:
        before = json.load(f)
      fuzzer.findings, fuzzer.kinds = before["findings"], collections.Counter(before["kinds"])
    fuzzer.setup()
    if args.replay:
      return fuzzer.replay(args.replay)
    if args.crash_note:
      fuzzer.crash_note = CrashNote(args.crash_note)
    try:
      return fuzzer.run()
    except Exception:  # pylint: disable=broad-except
      traceback.print_exc()
      return HARNESS_FAILED


if __name__ == "__main__":
  sys.exit(main())
