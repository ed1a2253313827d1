from hicache.proto_gen.hicache.v1 import hicache_pb2 as _hicache_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteRequest(_message.Message):
    __slots__ = ("namespace", "tokens", "token_ids", "policy", "exclude_nodes", "peek", "request_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_NODES_FIELD_NUMBER: _ClassVar[int]
    PEEK_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: _hicache_pb2.NamespaceRef
    tokens: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    policy: str
    exclude_nodes: _containers.RepeatedScalarFieldContainer[str]
    peek: bool
    request_id: str
    def __init__(self, namespace: _Optional[_Union[_hicache_pb2.NamespaceRef, _Mapping]] = ..., tokens: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., policy: _Optional[str] = ..., exclude_nodes: _Optional[_Iterable[str]] = ..., peek: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class NodeScore(_message.Message):
    __slots__ = ("node", "l1_pages", "l2_pages", "prefix_score", "in_flight", "queue_depth", "load", "cost", "eligible", "why_not")
    NODE_FIELD_NUMBER: _ClassVar[int]
    L1_PAGES_FIELD_NUMBER: _ClassVar[int]
    L2_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SCORE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    ELIGIBLE_FIELD_NUMBER: _ClassVar[int]
    WHY_NOT_FIELD_NUMBER: _ClassVar[int]
    node: str
    l1_pages: int
    l2_pages: int
    prefix_score: float
    in_flight: int
    queue_depth: int
    load: float
    cost: float
    eligible: bool
    why_not: str
    def __init__(self, node: _Optional[str] = ..., l1_pages: _Optional[int] = ..., l2_pages: _Optional[int] = ..., prefix_score: _Optional[float] = ..., in_flight: _Optional[int] = ..., queue_depth: _Optional[int] = ..., load: _Optional[float] = ..., cost: _Optional[float] = ..., eligible: _Optional[bool] = ..., why_not: _Optional[str] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("route_id", "node", "address", "l1_pages", "l2_pages", "num_pages", "page_size", "policy", "reason", "scores", "replayed")
    ROUTE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    L1_PAGES_FIELD_NUMBER: _ClassVar[int]
    L2_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    route_id: str
    node: str
    address: str
    l1_pages: int
    l2_pages: int
    num_pages: int
    page_size: int
    policy: str
    reason: str
    scores: _containers.RepeatedCompositeFieldContainer[NodeScore]
    replayed: bool
    def __init__(self, route_id: _Optional[str] = ..., node: _Optional[str] = ..., address: _Optional[str] = ..., l1_pages: _Optional[int] = ..., l2_pages: _Optional[int] = ..., num_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., policy: _Optional[str] = ..., reason: _Optional[str] = ..., scores: _Optional[_Iterable[_Union[NodeScore, _Mapping]]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("route_id", "status_code")
    ROUTE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    route_id: str
    status_code: int
    def __init__(self, route_id: _Optional[str] = ..., status_code: _Optional[int] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("known", "node", "late", "repeated")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    REPEATED_FIELD_NUMBER: _ClassVar[int]
    known: bool
    node: str
    late: bool
    repeated: bool
    def __init__(self, known: _Optional[bool] = ..., node: _Optional[str] = ..., late: _Optional[bool] = ..., repeated: _Optional[bool] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("name", "address", "connected", "server_id", "event_sequence", "resyncs", "l1_pages", "l2_pages", "in_flight", "queue_depth", "breaker", "routed", "namespace_ok", "last_error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    L1_PAGES_FIELD_NUMBER: _ClassVar[int]
    L2_PAGES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    BREAKER_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_OK_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    connected: bool
    server_id: str
    event_sequence: int
    resyncs: int
    l1_pages: int
    l2_pages: int
    in_flight: int
    queue_depth: int
    breaker: str
    routed: int
    namespace_ok: bool
    last_error: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., connected: _Optional[bool] = ..., server_id: _Optional[str] = ..., event_sequence: _Optional[int] = ..., resyncs: _Optional[int] = ..., l1_pages: _Optional[int] = ..., l2_pages: _Optional[int] = ..., in_flight: _Optional[int] = ..., queue_depth: _Optional[int] = ..., breaker: _Optional[str] = ..., routed: _Optional[int] = ..., namespace_ok: _Optional[bool] = ..., last_error: _Optional[str] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes", "namespace", "index")
    NODES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    namespace: str
    index: str
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., namespace: _Optional[str] = ..., index: _Optional[str] = ...) -> None: ...
