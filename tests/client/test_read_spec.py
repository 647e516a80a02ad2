"""What a host reads, said once (client/read_spec.py): the one builder of
every request the client sends, the dataset's kind, and the name errors
give; and RemoteDataset's attributes, which are its spec's."""

from __future__ import annotations

import dataclasses

import pytest

from grain_elevator.client import RemoteDataset, RetryPolicy, Security, TransportOptions
from grain_elevator.client.read_spec import Kind, ReadSpec
from grain_elevator.proto import elevator_pb2 as pb
from grain_elevator.proto.errors import InternalError
from fake_backend import FINGERPRINT, read_spec, step_info, stream_info

ZSTD = TransportOptions(compression="zstd")
HOST = {"dataset": "steps", "global_batch_size": 8, "shard_index": 1, "shard_count": 2,
        "config_fingerprint": FINGERPRINT}


@pytest.mark.parametrize("kwargs,transport,want", [
    # a fetch of a step dataset's chunk, in the transport's compression
    ({"record_offset": 12, "compressed": True}, ZSTD,
     {**HOST, "record_offset": 12, "compression": pb.COMPRESSION_ZSTD}),
    ({"compressed": True}, TransportOptions(), HOST),
    # a stream's chunk, or a skip (no batch comes back: never compressed)
    ({"stream_state": '{"at":3}', "compressed": True}, ZSTD,
     {**HOST, "stream_state": '{"at":3}', "compression": pb.COMPRESSION_ZSTD}),
    ({"stream_state": '{"at":3}'}, ZSTD, {**HOST, "stream_state": '{"at":3}'}),
    # an explain of this host's rows
    ({"record_offset": 5, "stream_state": ""}, ZSTD, {**HOST, "record_offset": 5}),
    # a summary counts the whole global batches
    ({"whole": True, "record_offset": 5}, ZSTD,
     {**HOST, "shard_index": 0, "shard_count": 1, "record_offset": 5}),
])
def test_the_request(kwargs, transport, want):
  spec = read_spec(step_info(), 8, 1, 2, transport=transport)
  assert spec.request(3, 2, **kwargs) == pb.BatchRequest(start_step=3, num_steps=2, **want)


@pytest.mark.parametrize("info,kind", [(step_info(), Kind.STEP),
                                       (stream_info(), Kind.STREAM)])
def test_the_kind_is_the_described_dataset_s(info, kind):
  assert read_spec(info).kind is kind


def test_an_undescribed_spec_has_no_kind_and_builds_no_request():
  spec = dataclasses.replace(read_spec(step_info()), info=None)
  with pytest.raises(InternalError, match="'steps' was not described yet"):
    spec.kind  # pylint: disable=pointless-statement
  with pytest.raises(InternalError):
    spec.request(0, 1)
  assert spec.described(step_info()) == read_spec(step_info())


def test_a_remote_dataset_s_attributes_are_its_spec_s():
  options = {"prefetch": 3, "window_bytes": 1 << 20, "transport": ZSTD,
             "retry": RetryPolicy(timeout_s=5), "security": Security(auth_token="t"),
             "stats_log_s": 2.0}
  ds = RemoteDataset(["a:1", "b:2"], "train", 8, shard_index=1, shard_count=2, **options)
  spec = ds._spec  # pylint: disable=protected-access
  assert spec == ReadSpec(targets=("a:1", "b:2"), dataset="train", global_batch_size=8,
                          shard_index=1, shard_count=2, **options)
  assert ds.targets == ["a:1", "b:2"]
  assert (ds.dataset, ds.global_batch_size, ds.shard_index, ds.shard_count) == ("train", 8, 1, 2)
  assert {name: getattr(ds, name) for name in options} == options
  assert str(ds) == str(spec) == "RemoteDataset(targets=['a:1', 'b:2'], dataset='train', G=8, h=1/2)"
  assert "auth_token" not in repr(spec) and "'t'" not in repr(spec)
