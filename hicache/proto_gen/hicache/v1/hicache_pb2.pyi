from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_L1: _ClassVar[Tier]
    TIER_L2: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_L1: Tier
TIER_L2: Tier

class NamespaceRef(_message.Message):
    __slots__ = ("tenant", "model", "revision", "layout")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model: str
    revision: str
    layout: str
    def __init__(self, tenant: _Optional[str] = ..., model: _Optional[str] = ..., revision: _Optional[str] = ..., layout: _Optional[str] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("request_id", "namespace", "tokens", "token_ids", "skip_l3", "load", "peek", "return_keys")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_L3_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    PEEK_FIELD_NUMBER: _ClassVar[int]
    RETURN_KEYS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    namespace: NamespaceRef
    tokens: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_l3: bool
    load: bool
    peek: bool
    return_keys: bool
    def __init__(self, request_id: _Optional[str] = ..., namespace: _Optional[_Union[NamespaceRef, _Mapping]] = ..., tokens: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., skip_l3: _Optional[bool] = ..., load: _Optional[bool] = ..., peek: _Optional[bool] = ..., return_keys: _Optional[bool] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("request_id", "l1_pages", "l2_pages", "l3_pages", "page_size", "num_pages", "device_indices", "page_keys", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    L1_PAGES_FIELD_NUMBER: _ClassVar[int]
    L2_PAGES_FIELD_NUMBER: _ClassVar[int]
    L3_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    PAGE_KEYS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    l1_pages: int
    l2_pages: int
    l3_pages: int
    page_size: int
    num_pages: int
    device_indices: _containers.RepeatedScalarFieldContainer[int]
    page_keys: _containers.RepeatedScalarFieldContainer[bytes]
    error: Error
    def __init__(self, request_id: _Optional[str] = ..., l1_pages: _Optional[int] = ..., l2_pages: _Optional[int] = ..., l3_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., device_indices: _Optional[_Iterable[int]] = ..., page_keys: _Optional[_Iterable[bytes]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("request_id", "stream_progress", "progress_interval_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    stream_progress: bool
    progress_interval_ms: int
    def __init__(self, request_id: _Optional[str] = ..., stream_progress: _Optional[bool] = ..., progress_interval_ms: _Optional[int] = ...) -> None: ...

class PrefetchProgress(_message.Message):
    __slots__ = ("pages_total", "pages_done", "done", "device_indices", "loaded_l2_pages", "loaded_l3_pages")
    PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAGES_DONE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    LOADED_L2_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOADED_L3_PAGES_FIELD_NUMBER: _ClassVar[int]
    pages_total: int
    pages_done: int
    done: bool
    device_indices: _containers.RepeatedScalarFieldContainer[int]
    loaded_l2_pages: int
    loaded_l3_pages: int
    def __init__(self, pages_total: _Optional[int] = ..., pages_done: _Optional[int] = ..., done: _Optional[bool] = ..., device_indices: _Optional[_Iterable[int]] = ..., loaded_l2_pages: _Optional[int] = ..., loaded_l3_pages: _Optional[int] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("request_id", "num_pages")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_pages: int
    def __init__(self, request_id: _Optional[str] = ..., num_pages: _Optional[int] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("device_indices",)
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    device_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, device_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("request_id", "tokens", "token_ids", "device_indices")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    device_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., device_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("new_pages", "reused_pages", "backed_up_pages", "device_indices")
    NEW_PAGES_FIELD_NUMBER: _ClassVar[int]
    REUSED_PAGES_FIELD_NUMBER: _ClassVar[int]
    BACKED_UP_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    new_pages: int
    reused_pages: int
    backed_up_pages: int
    device_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, new_pages: _Optional[int] = ..., reused_pages: _Optional[int] = ..., backed_up_pages: _Optional[int] = ..., device_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("l1_pages_total", "l1_pages_used", "l1_pages_cached", "l1_pages_locked", "l2_pages_total", "l2_pages_used", "l2_pages_cached", "writeback_queue_pages", "lookups", "lookup_tokens", "hit_tokens_l1", "hit_tokens_l2", "hit_tokens_l3", "open_requests", "event_sequence", "storage_pages_written", "storage_pages_read", "storage_errors", "storage_corrupt_pages", "pins", "pinned_l1_pages", "pinned_l2_pages", "storage_bytes_written", "storage_stored_bytes_written")
    L1_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    L1_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    L1_PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    L1_PAGES_LOCKED_FIELD_NUMBER: _ClassVar[int]
    L2_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    L2_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    L2_PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    WRITEBACK_QUEUE_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_L1_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_L2_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_L3_FIELD_NUMBER: _ClassVar[int]
    OPEN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_PAGES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    STORAGE_PAGES_READ_FIELD_NUMBER: _ClassVar[int]
    STORAGE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_CORRUPT_PAGES_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    PINNED_L1_PAGES_FIELD_NUMBER: _ClassVar[int]
    PINNED_L2_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    STORAGE_STORED_BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    l1_pages_total: int
    l1_pages_used: int
    l1_pages_cached: int
    l1_pages_locked: int
    l2_pages_total: int
    l2_pages_used: int
    l2_pages_cached: int
    writeback_queue_pages: int
    lookups: int
    lookup_tokens: int
    hit_tokens_l1: int
    hit_tokens_l2: int
    hit_tokens_l3: int
    open_requests: int
    event_sequence: int
    storage_pages_written: int
    storage_pages_read: int
    storage_errors: int
    storage_corrupt_pages: int
    pins: int
    pinned_l1_pages: int
    pinned_l2_pages: int
    storage_bytes_written: int
    storage_stored_bytes_written: int
    def __init__(self, l1_pages_total: _Optional[int] = ..., l1_pages_used: _Optional[int] = ..., l1_pages_cached: _Optional[int] = ..., l1_pages_locked: _Optional[int] = ..., l2_pages_total: _Optional[int] = ..., l2_pages_used: _Optional[int] = ..., l2_pages_cached: _Optional[int] = ..., writeback_queue_pages: _Optional[int] = ..., lookups: _Optional[int] = ..., lookup_tokens: _Optional[int] = ..., hit_tokens_l1: _Optional[int] = ..., hit_tokens_l2: _Optional[int] = ..., hit_tokens_l3: _Optional[int] = ..., open_requests: _Optional[int] = ..., event_sequence: _Optional[int] = ..., storage_pages_written: _Optional[int] = ..., storage_pages_read: _Optional[int] = ..., storage_errors: _Optional[int] = ..., storage_corrupt_pages: _Optional[int] = ..., pins: _Optional[int] = ..., pinned_l1_pages: _Optional[int] = ..., pinned_l2_pages: _Optional[int] = ..., storage_bytes_written: _Optional[int] = ..., storage_stored_bytes_written: _Optional[int] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("has_storage", "written_pages", "failed_pages", "dropped_pages", "pending_pages", "complete")
    HAS_STORAGE_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_PAGES_FIELD_NUMBER: _ClassVar[int]
    FAILED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PENDING_PAGES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    has_storage: bool
    written_pages: int
    failed_pages: int
    dropped_pages: int
    pending_pages: int
    complete: bool
    def __init__(self, has_storage: _Optional[bool] = ..., written_pages: _Optional[int] = ..., failed_pages: _Optional[int] = ..., dropped_pages: _Optional[int] = ..., pending_pages: _Optional[int] = ..., complete: _Optional[bool] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("namespace", "tokens", "token_ids")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace: NamespaceRef
    tokens: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[_Union[NamespaceRef, _Mapping]] = ..., tokens: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PinInfo(_message.Message):
    __slots__ = ("pin_id", "l1_pages", "l2_pages", "namespace")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    L1_PAGES_FIELD_NUMBER: _ClassVar[int]
    L2_PAGES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    pin_id: int
    l1_pages: int
    l2_pages: int
    namespace: str
    def __init__(self, pin_id: _Optional[int] = ..., l1_pages: _Optional[int] = ..., l2_pages: _Optional[int] = ..., namespace: _Optional[str] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("pin_id",)
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    pin_id: int
    def __init__(self, pin_id: _Optional[int] = ...) -> None: ...

class ListPinsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPinsResponse(_message.Message):
    __slots__ = ("pins",)
    PINS_FIELD_NUMBER: _ClassVar[int]
    pins: _containers.RepeatedCompositeFieldContainer[PinInfo]
    def __init__(self, pins: _Optional[_Iterable[_Union[PinInfo, _Mapping]]] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("l1_pages", "l2_pages")
    L1_PAGES_FIELD_NUMBER: _ClassVar[int]
    L2_PAGES_FIELD_NUMBER: _ClassVar[int]
    l1_pages: int
    l2_pages: int
    def __init__(self, l1_pages: _Optional[int] = ..., l2_pages: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("max_queue",)
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    max_queue: int
    def __init__(self, max_queue: _Optional[int] = ...) -> None: ...

class PageRun(_message.Message):
    __slots__ = ("namespace_digest", "parent_key", "page_keys", "tokens", "tiers")
    NAMESPACE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    PAGE_KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    namespace_digest: bytes
    parent_key: bytes
    page_keys: _containers.RepeatedScalarFieldContainer[bytes]
    tokens: bytes
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, namespace_digest: _Optional[bytes] = ..., parent_key: _Optional[bytes] = ..., page_keys: _Optional[_Iterable[bytes]] = ..., tokens: _Optional[bytes] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("sequence", "kind", "runs", "server_id", "snapshot_continues")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Event.Kind]
        STORED: _ClassVar[Event.Kind]
        REMOVED: _ClassVar[Event.Kind]
        TIER_CHANGED: _ClassVar[Event.Kind]
        SNAPSHOT: _ClassVar[Event.Kind]
    KIND_UNSPECIFIED: Event.Kind
    STORED: Event.Kind
    REMOVED: Event.Kind
    TIER_CHANGED: Event.Kind
    SNAPSHOT: Event.Kind
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_CONTINUES_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    kind: Event.Kind
    runs: _containers.RepeatedCompositeFieldContainer[PageRun]
    server_id: str
    snapshot_continues: bool
    def __init__(self, sequence: _Optional[int] = ..., kind: _Optional[_Union[Event.Kind, str]] = ..., runs: _Optional[_Iterable[_Union[PageRun, _Mapping]]] = ..., server_id: _Optional[str] = ..., snapshot_continues: _Optional[bool] = ...) -> None: ...

class GetPoolInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "page_size", "attention", "describe", "bytes_per_page")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    DESCRIBE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_PAGE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    attention: str
    describe: str
    bytes_per_page: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., attention: _Optional[str] = ..., describe: _Optional[str] = ..., bytes_per_page: _Optional[int] = ...) -> None: ...

class SharedMemoryHandle(_message.Message):
    __slots__ = ("name", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "size_bytes")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    size_bytes: int
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("layout", "num_pages", "device", "model", "revision", "tp_rank", "tp_size", "namespace_digest", "shm", "cuda_ipc", "host_pid", "hostname", "host_id")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    HOST_PID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    num_pages: int
    device: str
    model: str
    revision: str
    tp_rank: int
    tp_size: int
    namespace_digest: bytes
    shm: SharedMemoryHandle
    cuda_ipc: CudaIpcHandle
    host_pid: int
    hostname: str
    host_id: str
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_pages: _Optional[int] = ..., device: _Optional[str] = ..., model: _Optional[str] = ..., revision: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., namespace_digest: _Optional[bytes] = ..., shm: _Optional[_Union[SharedMemoryHandle, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., host_pid: _Optional[int] = ..., hostname: _Optional[str] = ..., host_id: _Optional[str] = ...) -> None: ...

class ReadPagesRequest(_message.Message):
    __slots__ = ("namespace", "tokens", "token_ids", "max_pages")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_PAGES_FIELD_NUMBER: _ClassVar[int]
    namespace: NamespaceRef
    tokens: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_pages: int
    def __init__(self, namespace: _Optional[_Union[NamespaceRef, _Mapping]] = ..., tokens: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_pages: _Optional[int] = ...) -> None: ...

class PageChunk(_message.Message):
    __slots__ = ("first_page", "num_pages", "page_keys", "data", "total_pages")
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_KEYS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    first_page: int
    num_pages: int
    page_keys: _containers.RepeatedScalarFieldContainer[bytes]
    data: bytes
    total_pages: int
    def __init__(self, first_page: _Optional[int] = ..., num_pages: _Optional[int] = ..., page_keys: _Optional[_Iterable[bytes]] = ..., data: _Optional[bytes] = ..., total_pages: _Optional[int] = ...) -> None: ...

class WritePagesHeader(_message.Message):
    __slots__ = ("namespace", "tokens", "token_ids", "first_page")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    namespace: NamespaceRef
    tokens: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_page: int
    def __init__(self, namespace: _Optional[_Union[NamespaceRef, _Mapping]] = ..., tokens: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., first_page: _Optional[int] = ...) -> None: ...

class WritePagesChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: WritePagesHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[WritePagesHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...
