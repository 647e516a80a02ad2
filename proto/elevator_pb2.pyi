from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_NONE: _ClassVar[Compression]
    COMPRESSION_ZSTD: _ClassVar[Compression]
COMPRESSION_NONE: Compression
COMPRESSION_ZSTD: Compression

class DescribeRequest(_message.Message):
    __slots__ = ("dataset", "global_batch_size")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    global_batch_size: int
    def __init__(self, dataset: _Optional[str] = ..., global_batch_size: _Optional[int] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("datasets", "server")
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    server: ServerInfo
    def __init__(self, datasets: _Optional[_Iterable[_Union[DatasetInfo, _Mapping]]] = ..., server: _Optional[_Union[ServerInfo, _Mapping]] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("worker_index", "num_workers", "bulk_port")
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    worker_index: int
    num_workers: int
    bulk_port: int
    def __init__(self, worker_index: _Optional[int] = ..., num_workers: _Optional[int] = ..., bulk_port: _Optional[int] = ...) -> None: ...

class DatasetInfo(_message.Message):
    __slots__ = ("name", "num_records", "num_epochs", "shuffle", "seed", "config_fingerprint", "element_spec", "global_batch_size", "steps_per_epoch", "total_steps", "pad_remainder", "segment_steps", "segment_fingerprints", "stream", "stream_start", "stream_shards", "stream_starts")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_RECORDS_FIELD_NUMBER: _ClassVar[int]
    NUM_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_SPEC_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    PAD_REMAINDER_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_STEPS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    STREAM_START_FIELD_NUMBER: _ClassVar[int]
    STREAM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    STREAM_STARTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_records: int
    num_epochs: int
    shuffle: bool
    seed: int
    config_fingerprint: str
    element_spec: ElementSpec
    global_batch_size: int
    steps_per_epoch: int
    total_steps: int
    pad_remainder: bool
    segment_steps: _containers.RepeatedScalarFieldContainer[int]
    segment_fingerprints: _containers.RepeatedScalarFieldContainer[str]
    stream: bool
    stream_start: str
    stream_shards: int
    stream_starts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., num_records: _Optional[int] = ..., num_epochs: _Optional[int] = ..., shuffle: _Optional[bool] = ..., seed: _Optional[int] = ..., config_fingerprint: _Optional[str] = ..., element_spec: _Optional[_Union[ElementSpec, _Mapping]] = ..., global_batch_size: _Optional[int] = ..., steps_per_epoch: _Optional[int] = ..., total_steps: _Optional[int] = ..., pad_remainder: _Optional[bool] = ..., segment_steps: _Optional[_Iterable[int]] = ..., segment_fingerprints: _Optional[_Iterable[str]] = ..., stream: _Optional[bool] = ..., stream_start: _Optional[str] = ..., stream_shards: _Optional[int] = ..., stream_starts: _Optional[_Iterable[str]] = ...) -> None: ...

class ElementSpec(_message.Message):
    __slots__ = ("structure", "leaves")
    STRUCTURE_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    structure: str
    leaves: _containers.RepeatedCompositeFieldContainer[LeafSpec]
    def __init__(self, structure: _Optional[str] = ..., leaves: _Optional[_Iterable[_Union[LeafSpec, _Mapping]]] = ...) -> None: ...

class LeafSpec(_message.Message):
    __slots__ = ("path", "dtype", "shape")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    path: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, path: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("dataset", "global_batch_size", "shard_index", "shard_count", "start_step", "num_steps", "config_fingerprint", "compression", "record_offset", "stream_state", "report_production", "stream_shard", "stream_shards")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    RECORD_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STREAM_STATE_FIELD_NUMBER: _ClassVar[int]
    REPORT_PRODUCTION_FIELD_NUMBER: _ClassVar[int]
    STREAM_SHARD_FIELD_NUMBER: _ClassVar[int]
    STREAM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    global_batch_size: int
    shard_index: int
    shard_count: int
    start_step: int
    num_steps: int
    config_fingerprint: str
    compression: Compression
    record_offset: int
    stream_state: str
    report_production: bool
    stream_shard: int
    stream_shards: int
    def __init__(self, dataset: _Optional[str] = ..., global_batch_size: _Optional[int] = ..., shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ..., start_step: _Optional[int] = ..., num_steps: _Optional[int] = ..., config_fingerprint: _Optional[str] = ..., compression: _Optional[_Union[Compression, str]] = ..., record_offset: _Optional[int] = ..., stream_state: _Optional[str] = ..., report_production: _Optional[bool] = ..., stream_shard: _Optional[int] = ..., stream_shards: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "compression")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    compression: Compression
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., compression: _Optional[_Union[Compression, str]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("step", "leaves", "next_stream_state", "production_us")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    NEXT_STREAM_STATE_FIELD_NUMBER: _ClassVar[int]
    PRODUCTION_US_FIELD_NUMBER: _ClassVar[int]
    step: int
    leaves: _containers.RepeatedCompositeFieldContainer[Tensor]
    next_stream_state: str
    production_us: int
    def __init__(self, step: _Optional[int] = ..., leaves: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., next_stream_state: _Optional[str] = ..., production_us: _Optional[int] = ...) -> None: ...

class SkipResponse(_message.Message):
    __slots__ = ("next_step", "next_stream_state", "stream_ended")
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    NEXT_STREAM_STATE_FIELD_NUMBER: _ClassVar[int]
    STREAM_ENDED_FIELD_NUMBER: _ClassVar[int]
    next_step: int
    next_stream_state: str
    stream_ended: bool
    def __init__(self, next_step: _Optional[int] = ..., next_stream_state: _Optional[str] = ..., stream_ended: _Optional[bool] = ...) -> None: ...

class ExplainRequest(_message.Message):
    __slots__ = ("request", "summary")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    request: BatchRequest
    summary: bool
    def __init__(self, request: _Optional[_Union[BatchRequest, _Mapping]] = ..., summary: _Optional[bool] = ...) -> None: ...

class ExplainResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class BulkRequest(_message.Message):
    __slots__ = ("request", "auth_token")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    AUTH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request: BatchRequest
    auth_token: str
    def __init__(self, request: _Optional[_Union[BatchRequest, _Mapping]] = ..., auth_token: _Optional[str] = ...) -> None: ...

class BulkStatus(_message.Message):
    __slots__ = ("code", "message", "error_type")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    error_type: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., error_type: _Optional[str] = ...) -> None: ...
