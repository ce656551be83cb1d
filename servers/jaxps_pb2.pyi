from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT64: DType
FLOAT16: DType
BFLOAT16: DType
INT32: DType
INT64: DType

class Header(_message.Message):
    __slots__ = ("version", "job_id", "rank", "key", "round", "dtype", "length", "name", "session", "signature", "description", "check_key", "check_round", "check_call", "abort")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CHECK_KEY_FIELD_NUMBER: _ClassVar[int]
    CHECK_ROUND_FIELD_NUMBER: _ClassVar[int]
    CHECK_CALL_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    version: int
    job_id: str
    rank: int
    key: int
    round: int
    dtype: DType
    length: int
    name: str
    session: str
    signature: int
    description: str
    check_key: int
    check_round: int
    check_call: str
    abort: str
    def __init__(self, version: _Optional[int] = ..., job_id: _Optional[str] = ..., rank: _Optional[int] = ..., key: _Optional[int] = ..., round: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., length: _Optional[int] = ..., name: _Optional[str] = ..., session: _Optional[str] = ..., signature: _Optional[int] = ..., description: _Optional[str] = ..., check_key: _Optional[int] = ..., check_round: _Optional[int] = ..., check_call: _Optional[str] = ..., abort: _Optional[str] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("version", "job_id", "rank", "num_workers", "session", "init_id", "timeout", "generation")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    INIT_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    version: int
    job_id: str
    rank: int
    num_workers: int
    session: str
    init_id: str
    timeout: float
    generation: int
    def __init__(self, version: _Optional[int] = ..., job_id: _Optional[str] = ..., rank: _Optional[int] = ..., num_workers: _Optional[int] = ..., session: _Optional[str] = ..., init_id: _Optional[str] = ..., timeout: _Optional[float] = ..., generation: _Optional[int] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("version", "incarnation", "num_workers", "job_id", "async_mode", "data_port", "data_nonce", "session", "shm_socket")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ASYNC_MODE_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_NONCE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SHM_SOCKET_FIELD_NUMBER: _ClassVar[int]
    version: int
    incarnation: str
    num_workers: int
    job_id: str
    async_mode: bool
    data_port: int
    data_nonce: bytes
    session: str
    shm_socket: str
    def __init__(self, version: _Optional[int] = ..., incarnation: _Optional[str] = ..., num_workers: _Optional[int] = ..., job_id: _Optional[str] = ..., async_mode: _Optional[bool] = ..., data_port: _Optional[int] = ..., data_nonce: _Optional[bytes] = ..., session: _Optional[str] = ..., shm_socket: _Optional[str] = ...) -> None: ...

class ShmSlot(_message.Message):
    __slots__ = ("segment", "offset")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    segment: int
    offset: int
    def __init__(self, segment: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("header", "size", "cookie")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    COOKIE_FIELD_NUMBER: _ClassVar[int]
    header: Header
    size: int
    cookie: bytes
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., size: _Optional[int] = ..., cookie: _Optional[bytes] = ...) -> None: ...

class AttachReply(_message.Message):
    __slots__ = ("incarnation", "segment")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    segment: int
    def __init__(self, incarnation: _Optional[str] = ..., segment: _Optional[int] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("header", "segments")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    header: Header
    segments: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., segments: _Optional[_Iterable[int]] = ...) -> None: ...

class DetachReply(_message.Message):
    __slots__ = ("incarnation",)
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    def __init__(self, incarnation: _Optional[str] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "payload", "checksum", "slot")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    header: Header
    payload: bytes
    checksum: int
    slot: ShmSlot
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., payload: _Optional[bytes] = ..., checksum: _Optional[int] = ..., slot: _Optional[_Union[ShmSlot, _Mapping]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("incarnation",)
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    def __init__(self, incarnation: _Optional[str] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("header", "slot")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    header: Header
    slot: ShmSlot
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., slot: _Optional[_Union[ShmSlot, _Mapping]] = ...) -> None: ...

class ByeRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: Header
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ...) -> None: ...

class ByeReply(_message.Message):
    __slots__ = ("incarnation",)
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    def __init__(self, incarnation: _Optional[str] = ...) -> None: ...

class PullReply(_message.Message):
    __slots__ = ("incarnation", "payload", "in_slot", "contributors")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    IN_SLOT_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    payload: bytes
    in_slot: bool
    contributors: int
    def __init__(self, incarnation: _Optional[str] = ..., payload: _Optional[bytes] = ..., in_slot: _Optional[bool] = ..., contributors: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("header", "timeout")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    header: Header
    timeout: float
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., timeout: _Optional[float] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("incarnation", "last_rank")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LAST_RANK_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    last_rank: int
    def __init__(self, incarnation: _Optional[str] = ..., last_rank: _Optional[int] = ...) -> None: ...

class RendezvousRequest(_message.Message):
    __slots__ = ("version", "job_id", "member", "generation", "expected", "settle", "timeout", "hint", "probe")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    SETTLE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    version: int
    job_id: str
    member: str
    generation: int
    expected: int
    settle: float
    timeout: float
    hint: int
    probe: bool
    def __init__(self, version: _Optional[int] = ..., job_id: _Optional[str] = ..., member: _Optional[str] = ..., generation: _Optional[int] = ..., expected: _Optional[int] = ..., settle: _Optional[float] = ..., timeout: _Optional[float] = ..., hint: _Optional[int] = ..., probe: _Optional[bool] = ...) -> None: ...

class RendezvousReply(_message.Message):
    __slots__ = ("incarnation", "generation", "members", "waiting")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    generation: int
    members: _containers.RepeatedScalarFieldContainer[str]
    waiting: int
    def __init__(self, incarnation: _Optional[str] = ..., generation: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., waiting: _Optional[int] = ...) -> None: ...
