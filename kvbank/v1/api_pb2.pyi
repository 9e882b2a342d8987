from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CacheSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_SOURCE_UNSPECIFIED: _ClassVar[CacheSource]
    CACHE_SOURCE_NONE: _ClassVar[CacheSource]
    CACHE_SOURCE_RAM: _ClassVar[CacheSource]
    CACHE_SOURCE_SSD: _ClassVar[CacheSource]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
CACHE_SOURCE_UNSPECIFIED: CacheSource
CACHE_SOURCE_NONE: CacheSource
CACHE_SOURCE_RAM: CacheSource
CACHE_SOURCE_SSD: CacheSource
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    reasoning: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ..., reasoning: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "tools_json", "tool_choice")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    tool_choice: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ..., tool_choice: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "seed", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "penalty_window", "logprobs", "top_logprobs", "top_k", "min_p")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PENALTY_WINDOW_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    logit_bias: _containers.ScalarMap[int, float]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    penalty_window: int
    logprobs: bool
    top_logprobs: int
    top_k: int
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., penalty_window: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("type", "json_schema")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    type: str
    json_schema: str
    def __init__(self, type: _Optional[str] = ..., json_schema: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "chat", "prompt", "tokens", "append", "sampling", "max_tokens", "stop", "no_cache", "fit_max_tokens", "response_format", "enable_thinking")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    NO_CACHE_FIELD_NUMBER: _ClassVar[int]
    FIT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ENABLE_THINKING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    chat: ChatMessages
    prompt: str
    tokens: TokenIds
    append: bool
    sampling: SamplingParams
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    no_cache: bool
    fit_max_tokens: bool
    response_format: ResponseFormat
    enable_thinking: bool
    def __init__(self, session_id: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt: _Optional[str] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., append: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., no_cache: _Optional[bool] = ..., fit_max_tokens: _Optional[bool] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., enable_thinking: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "cache_source", "recomputed_tokens", "ttft_s", "queue_s", "durable", "session_id", "max_tokens", "prefix_lost_tokens", "reasoning_tokens", "drafted_tokens", "accepted_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_source: CacheSource
    recomputed_tokens: int
    ttft_s: float
    queue_s: float
    durable: bool
    session_id: str
    max_tokens: int
    prefix_lost_tokens: int
    reasoning_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cache_source: _Optional[_Union[CacheSource, str]] = ..., recomputed_tokens: _Optional[int] = ..., ttft_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., durable: _Optional[bool] = ..., session_id: _Optional[str] = ..., max_tokens: _Optional[int] = ..., prefix_lost_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "usage", "logprobs", "tool_calls", "stop_sequence", "reasoning")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    stop_sequence: str
    reasoning: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., stop_sequence: _Optional[str] = ..., reasoning: _Optional[str] = ...) -> None: ...

class RenderResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "token_count", "durable_tokens", "ram_bytes", "created_at", "updated_at", "token_ids", "state", "tenant", "checkpoint_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    DURABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_count: int
    durable_tokens: int
    ram_bytes: int
    created_at: float
    updated_at: float
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    state: str
    tenant: str
    checkpoint_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., token_count: _Optional[int] = ..., durable_tokens: _Optional[int] = ..., ram_bytes: _Optional[int] = ..., created_at: _Optional[float] = ..., updated_at: _Optional[float] = ..., token_ids: _Optional[_Iterable[int]] = ..., state: _Optional[str] = ..., tenant: _Optional[str] = ..., checkpoint_bytes: _Optional[int] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    def __init__(self, sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DeleteSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DeleteSessionResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("running", "waiting", "kv_cache_usage", "kv_bytes", "kv_capacity_bytes", "kv_tokens", "kv_capacity_tokens", "max_running")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_cache_usage: float
    kv_bytes: int
    kv_capacity_bytes: int
    kv_tokens: int
    kv_capacity_tokens: int
    max_running: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., kv_capacity_bytes: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., max_running: _Optional[int] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("status", "ram_tokens", "ssd_tokens", "restored_tokens")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RAM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SSD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    status: str
    ram_tokens: int
    ssd_tokens: int
    restored_tokens: int
    def __init__(self, status: _Optional[str] = ..., ram_tokens: _Optional[int] = ..., ssd_tokens: _Optional[int] = ..., restored_tokens: _Optional[int] = ...) -> None: ...

class StoredResponse(_message.Message):
    __slots__ = ("id", "created_at", "body")
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    id: str
    created_at: float
    body: bytes
    def __init__(self, id: _Optional[str] = ..., created_at: _Optional[float] = ..., body: _Optional[bytes] = ...) -> None: ...

class ResponseRef(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class PutResponseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeleteResponseReply(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "write_out", "tenant")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WRITE_OUT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    write_out: bool
    tenant: str
    def __init__(self, session_id: _Optional[str] = ..., write_out: _Optional[bool] = ..., tenant: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released_entries", "released_bytes", "written_out_entries", "dropped_unwritten_entries")
    RELEASED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_OUT_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_UNWRITTEN_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    released_entries: int
    released_bytes: int
    written_out_entries: int
    dropped_unwritten_entries: int
    def __init__(self, released_entries: _Optional[int] = ..., released_bytes: _Optional[int] = ..., written_out_entries: _Optional[int] = ..., dropped_unwritten_entries: _Optional[int] = ...) -> None: ...

class PressureRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: str
    def __init__(self, level: _Optional[str] = ...) -> None: ...

class PressureResponse(_message.Message):
    __slots__ = ("level", "source")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    level: str
    source: str
    def __init__(self, level: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class TrimRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrimResponse(_message.Message):
    __slots__ = ("evicted_entries", "unwritten_kept", "bank_bytes_after")
    EVICTED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    UNWRITTEN_KEPT_FIELD_NUMBER: _ClassVar[int]
    BANK_BYTES_AFTER_FIELD_NUMBER: _ClassVar[int]
    evicted_entries: int
    unwritten_kept: int
    bank_bytes_after: int
    def __init__(self, evicted_entries: _Optional[int] = ..., unwritten_kept: _Optional[int] = ..., bank_bytes_after: _Optional[int] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("written_entries", "failed_entries", "seconds")
    WRITTEN_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    FAILED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    written_entries: int
    failed_entries: int
    seconds: float
    def __init__(self, written_entries: _Optional[int] = ..., failed_entries: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("pressure_level", "pressure_source", "memory_budget_bytes", "held_bytes", "fixed_bytes", "bank_bytes", "running_bytes", "staged_bytes", "bank_max_bytes", "bank_ceiling_bytes", "bank_entries", "scheduler", "running_requests", "waiting_requests", "recent_receipts_json", "kv_bytes_per_token", "prefill_chunk_tokens", "transient_base_bytes", "transient_per_context_token", "unaccounted_bytes", "rss_bytes", "coldstore_json", "recent_evictions_json", "mlx_cache_bytes", "kv_bits", "scope", "mtp")
    PRESSURE_LEVEL_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIXED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BANK_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BANK_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    BANK_CEILING_BYTES_FIELD_NUMBER: _ClassVar[int]
    BANK_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RECENT_RECEIPTS_JSON_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSIENT_BASE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSIENT_PER_CONTEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    UNACCOUNTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    COLDSTORE_JSON_FIELD_NUMBER: _ClassVar[int]
    RECENT_EVICTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    MLX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    MTP_FIELD_NUMBER: _ClassVar[int]
    pressure_level: str
    pressure_source: str
    memory_budget_bytes: int
    held_bytes: int
    fixed_bytes: int
    bank_bytes: int
    running_bytes: int
    staged_bytes: int
    bank_max_bytes: int
    bank_ceiling_bytes: int
    bank_entries: int
    scheduler: str
    running_requests: int
    waiting_requests: int
    recent_receipts_json: _containers.RepeatedScalarFieldContainer[str]
    kv_bytes_per_token: int
    prefill_chunk_tokens: int
    transient_base_bytes: int
    transient_per_context_token: float
    unaccounted_bytes: int
    rss_bytes: int
    coldstore_json: str
    recent_evictions_json: _containers.RepeatedScalarFieldContainer[str]
    mlx_cache_bytes: int
    kv_bits: int
    scope: str
    mtp: str
    def __init__(self, pressure_level: _Optional[str] = ..., pressure_source: _Optional[str] = ..., memory_budget_bytes: _Optional[int] = ..., held_bytes: _Optional[int] = ..., fixed_bytes: _Optional[int] = ..., bank_bytes: _Optional[int] = ..., running_bytes: _Optional[int] = ..., staged_bytes: _Optional[int] = ..., bank_max_bytes: _Optional[int] = ..., bank_ceiling_bytes: _Optional[int] = ..., bank_entries: _Optional[int] = ..., scheduler: _Optional[str] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., recent_receipts_json: _Optional[_Iterable[str]] = ..., kv_bytes_per_token: _Optional[int] = ..., prefill_chunk_tokens: _Optional[int] = ..., transient_base_bytes: _Optional[int] = ..., transient_per_context_token: _Optional[float] = ..., unaccounted_bytes: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., coldstore_json: _Optional[str] = ..., recent_evictions_json: _Optional[_Iterable[str]] = ..., mlx_cache_bytes: _Optional[int] = ..., kv_bits: _Optional[int] = ..., scope: _Optional[str] = ..., mtp: _Optional[str] = ...) -> None: ...
