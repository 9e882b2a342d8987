from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    OUTCOME_WRITTEN: _ClassVar[Outcome]
    OUTCOME_SUPERSEDED: _ClassVar[Outcome]
    OUTCOME_CANCELLED: _ClassVar[Outcome]
    OUTCOME_DEADLINE: _ClassVar[Outcome]
    OUTCOME_REFUSED: _ClassVar[Outcome]
    OUTCOME_ERROR: _ClassVar[Outcome]
    OUTCOME_STALE: _ClassVar[Outcome]
    OUTCOME_UNKNOWN_JOB: _ClassVar[Outcome]
OUTCOME_UNSPECIFIED: Outcome
OUTCOME_WRITTEN: Outcome
OUTCOME_SUPERSEDED: Outcome
OUTCOME_CANCELLED: Outcome
OUTCOME_DEADLINE: Outcome
OUTCOME_REFUSED: Outcome
OUTCOME_ERROR: Outcome
OUTCOME_STALE: Outcome
OUTCOME_UNKNOWN_JOB: Outcome

class Request(_message.Message):
    __slots__ = ("req", "put_session", "delete_session", "write", "payload", "promote", "cancel", "get_blocks", "ping", "drop_blocks", "put_response", "get_response", "delete_response")
    REQ_FIELD_NUMBER: _ClassVar[int]
    PUT_SESSION_FIELD_NUMBER: _ClassVar[int]
    DELETE_SESSION_FIELD_NUMBER: _ClassVar[int]
    WRITE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    GET_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    DROP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PUT_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    GET_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    DELETE_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    req: int
    put_session: PutSession
    delete_session: DeleteSession
    write: Write
    payload: Payload
    promote: Promote
    cancel: Cancel
    get_blocks: GetBlocks
    ping: Ping
    drop_blocks: DropBlocks
    put_response: PutResponse
    get_response: ResponseKey
    delete_response: ResponseKey
    def __init__(self, req: _Optional[int] = ..., put_session: _Optional[_Union[PutSession, _Mapping]] = ..., delete_session: _Optional[_Union[DeleteSession, _Mapping]] = ..., write: _Optional[_Union[Write, _Mapping]] = ..., payload: _Optional[_Union[Payload, _Mapping]] = ..., promote: _Optional[_Union[Promote, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., get_blocks: _Optional[_Union[GetBlocks, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ..., drop_blocks: _Optional[_Union[DropBlocks, _Mapping]] = ..., put_response: _Optional[_Union[PutResponse, _Mapping]] = ..., get_response: _Optional[_Union[ResponseKey, _Mapping]] = ..., delete_response: _Optional[_Union[ResponseKey, _Mapping]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("tenant", "id", "created_at")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    id: str
    created_at: float
    def __init__(self, tenant: _Optional[str] = ..., id: _Optional[str] = ..., created_at: _Optional[float] = ...) -> None: ...

class ResponseKey(_message.Message):
    __slots__ = ("tenant", "id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    id: str
    def __init__(self, tenant: _Optional[str] = ..., id: _Optional[str] = ...) -> None: ...

class PutSession(_message.Message):
    __slots__ = ("tenant", "session_id", "block_tokens")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    session_id: str
    block_tokens: int
    def __init__(self, tenant: _Optional[str] = ..., session_id: _Optional[str] = ..., block_tokens: _Optional[int] = ...) -> None: ...

class DeleteSession(_message.Message):
    __slots__ = ("tenant", "session_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    session_id: str
    def __init__(self, tenant: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class Block(_message.Message):
    __slots__ = ("id", "start", "nbytes", "tail", "anchor")
    ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    id: bytes
    start: int
    nbytes: int
    tail: bool
    anchor: bool
    def __init__(self, id: _Optional[bytes] = ..., start: _Optional[int] = ..., nbytes: _Optional[int] = ..., tail: _Optional[bool] = ..., anchor: _Optional[bool] = ...) -> None: ...

class Write(_message.Message):
    __slots__ = ("job", "tenant", "session_id", "root", "blocks", "dirty_since", "give_up_at", "shm", "shm_released")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DIRTY_SINCE_FIELD_NUMBER: _ClassVar[int]
    GIVE_UP_AT_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    SHM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    job: int
    tenant: str
    session_id: str
    root: bytes
    blocks: _containers.RepeatedCompositeFieldContainer[Block]
    dirty_since: float
    give_up_at: float
    shm: _containers.RepeatedScalarFieldContainer[str]
    shm_released: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job: _Optional[int] = ..., tenant: _Optional[str] = ..., session_id: _Optional[str] = ..., root: _Optional[bytes] = ..., blocks: _Optional[_Iterable[_Union[Block, _Mapping]]] = ..., dirty_since: _Optional[float] = ..., give_up_at: _Optional[float] = ..., shm: _Optional[_Iterable[str]] = ..., shm_released: _Optional[_Iterable[str]] = ...) -> None: ...

class Payload(_message.Message):
    __slots__ = ("job", "shm", "shm_released")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    SHM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    job: int
    shm: _containers.RepeatedScalarFieldContainer[str]
    shm_released: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job: _Optional[int] = ..., shm: _Optional[_Iterable[str]] = ..., shm_released: _Optional[_Iterable[str]] = ...) -> None: ...

class Promote(_message.Message):
    __slots__ = ("job", "give_up_at")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GIVE_UP_AT_FIELD_NUMBER: _ClassVar[int]
    job: int
    give_up_at: float
    def __init__(self, job: _Optional[int] = ..., give_up_at: _Optional[float] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: int
    def __init__(self, job: _Optional[int] = ...) -> None: ...

class GetBlocks(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, ids: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DropBlocks(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, ids: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ("shm_probe",)
    SHM_PROBE_FIELD_NUMBER: _ClassVar[int]
    shm_probe: str
    def __init__(self, shm_probe: _Optional[str] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("reply", "progress", "done", "retired")
    REPLY_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    RETIRED_FIELD_NUMBER: _ClassVar[int]
    reply: Reply
    progress: Progress
    done: Done
    retired: Retired
    def __init__(self, reply: _Optional[_Union[Reply, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., retired: _Optional[_Union[Retired, _Mapping]] = ...) -> None: ...

class Reply(_message.Message):
    __slots__ = ("req", "ok", "error", "put_session", "delete_session", "get_blocks", "ping", "get_response", "delete_response")
    REQ_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PUT_SESSION_FIELD_NUMBER: _ClassVar[int]
    DELETE_SESSION_FIELD_NUMBER: _ClassVar[int]
    GET_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    GET_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    DELETE_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    req: int
    ok: bool
    error: str
    put_session: SessionPut
    delete_session: SessionDeleted
    get_blocks: BlocksFollow
    ping: PingReply
    get_response: ResponseFollows
    delete_response: SessionDeleted
    def __init__(self, req: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., put_session: _Optional[_Union[SessionPut, _Mapping]] = ..., delete_session: _Optional[_Union[SessionDeleted, _Mapping]] = ..., get_blocks: _Optional[_Union[BlocksFollow, _Mapping]] = ..., ping: _Optional[_Union[PingReply, _Mapping]] = ..., get_response: _Optional[_Union[ResponseFollows, _Mapping]] = ..., delete_response: _Optional[_Union[SessionDeleted, _Mapping]] = ...) -> None: ...

class ResponseFollows(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class SessionPut(_message.Message):
    __slots__ = ("durable_tokens",)
    DURABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    durable_tokens: int
    def __init__(self, durable_tokens: _Optional[int] = ...) -> None: ...

class SessionDeleted(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class BlocksFollow(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreStats(_message.Message):
    __slots__ = ("blocks", "sessions", "block_bytes", "map_bytes", "used_bytes")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    sessions: int
    block_bytes: int
    map_bytes: int
    used_bytes: int
    def __init__(self, blocks: _Optional[int] = ..., sessions: _Optional[int] = ..., block_bytes: _Optional[int] = ..., map_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ...) -> None: ...

class PingReply(_message.Message):
    __slots__ = ("stats", "worker_state", "queued_jobs", "jobs", "staged_bytes", "written_bytes", "write_budget_left_bytes", "free_disk_bytes", "shm_ok")
    STATS_FIELD_NUMBER: _ClassVar[int]
    WORKER_STATE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_JOBS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_BUDGET_LEFT_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_OK_FIELD_NUMBER: _ClassVar[int]
    stats: StoreStats
    worker_state: str
    queued_jobs: int
    jobs: _containers.RepeatedScalarFieldContainer[int]
    staged_bytes: int
    written_bytes: int
    write_budget_left_bytes: int
    free_disk_bytes: int
    shm_ok: bool
    def __init__(self, stats: _Optional[_Union[StoreStats, _Mapping]] = ..., worker_state: _Optional[str] = ..., queued_jobs: _Optional[int] = ..., jobs: _Optional[_Iterable[int]] = ..., staged_bytes: _Optional[int] = ..., written_bytes: _Optional[int] = ..., write_budget_left_bytes: _Optional[int] = ..., free_disk_bytes: _Optional[int] = ..., shm_ok: _Optional[bool] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("job", "tenant", "session_id", "durable_tokens")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DURABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    job: int
    tenant: str
    session_id: str
    durable_tokens: int
    def __init__(self, job: _Optional[int] = ..., tenant: _Optional[str] = ..., session_id: _Optional[str] = ..., durable_tokens: _Optional[int] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("job", "outcome", "tenant", "session_id", "durable_tokens", "error", "reason", "taken_back", "by")
    JOB_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DURABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TAKEN_BACK_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    job: int
    outcome: Outcome
    tenant: str
    session_id: str
    durable_tokens: int
    error: str
    reason: str
    taken_back: bool
    by: int
    def __init__(self, job: _Optional[int] = ..., outcome: _Optional[_Union[Outcome, str]] = ..., tenant: _Optional[str] = ..., session_id: _Optional[str] = ..., durable_tokens: _Optional[int] = ..., error: _Optional[str] = ..., reason: _Optional[str] = ..., taken_back: _Optional[bool] = ..., by: _Optional[int] = ...) -> None: ...

class Retired(_message.Message):
    __slots__ = ("tenant", "session_id", "reason", "removed", "at", "durable_tokens")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    DURABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    session_id: str
    reason: str
    removed: str
    at: float
    durable_tokens: int
    def __init__(self, tenant: _Optional[str] = ..., session_id: _Optional[str] = ..., reason: _Optional[str] = ..., removed: _Optional[str] = ..., at: _Optional[float] = ..., durable_tokens: _Optional[int] = ...) -> None: ...
