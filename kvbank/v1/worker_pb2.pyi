from kvbank.v1 import api_pb2 as _api_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "token_ids", "sampling", "max_tokens", "no_cache", "received_at", "stop", "tenant", "tools_json", "tool_choice", "response_format", "checkpoint_at", "split_reasoning", "shared_checkpoint_at")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NO_CACHE_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_AT_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_AT_FIELD_NUMBER: _ClassVar[int]
    SPLIT_REASONING_FIELD_NUMBER: _ClassVar[int]
    SHARED_CHECKPOINT_AT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _api_pb2.SamplingParams
    max_tokens: int
    no_cache: bool
    received_at: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    tenant: str
    tools_json: str
    tool_choice: str
    response_format: _api_pb2.ResponseFormat
    checkpoint_at: _containers.RepeatedScalarFieldContainer[int]
    split_reasoning: bool
    shared_checkpoint_at: int
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_api_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., no_cache: _Optional[bool] = ..., received_at: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., tenant: _Optional[str] = ..., tools_json: _Optional[str] = ..., tool_choice: _Optional[str] = ..., response_format: _Optional[_Union[_api_pb2.ResponseFormat, _Mapping]] = ..., checkpoint_at: _Optional[_Iterable[int]] = ..., split_reasoning: _Optional[bool] = ..., shared_checkpoint_at: _Optional[int] = ...) -> None: ...

class WorkerGenerateResponse(_message.Message):
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
    finish_reason: _api_pb2.FinishReason
    usage: _api_pb2.Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[_api_pb2.TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[_api_pb2.ToolCall]
    stop_sequence: str
    reasoning: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_api_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_api_pb2.Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_api_pb2.TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[_api_pb2.ToolCall, _Mapping]]] = ..., stop_sequence: _Optional[str] = ..., reasoning: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_path", "fingerprint", "max_context_tokens", "kv_bytes_per_token", "block_tokens", "eos_token_ids", "scheduler", "max_active_requests", "memory_budget_bytes", "fixed_bytes", "max_fit_tokens", "prefill_chunk_tokens", "transient_base_bytes", "transient_per_context_token", "tool_parser", "tool_call_start", "tool_call_end", "checkpointed", "cache_layout", "max_grammar_bytes")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    MAX_ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIXED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_FIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSIENT_BASE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSIENT_PER_CONTEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOOL_PARSER_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_START_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_END_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTED_FIELD_NUMBER: _ClassVar[int]
    CACHE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAMMAR_BYTES_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    fingerprint: str
    max_context_tokens: int
    kv_bytes_per_token: int
    block_tokens: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    scheduler: str
    max_active_requests: int
    memory_budget_bytes: int
    fixed_bytes: int
    max_fit_tokens: int
    prefill_chunk_tokens: int
    transient_base_bytes: int
    transient_per_context_token: float
    tool_parser: str
    tool_call_start: str
    tool_call_end: str
    checkpointed: bool
    cache_layout: str
    max_grammar_bytes: int
    def __init__(self, model_path: _Optional[str] = ..., fingerprint: _Optional[str] = ..., max_context_tokens: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., block_tokens: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., scheduler: _Optional[str] = ..., max_active_requests: _Optional[int] = ..., memory_budget_bytes: _Optional[int] = ..., fixed_bytes: _Optional[int] = ..., max_fit_tokens: _Optional[int] = ..., prefill_chunk_tokens: _Optional[int] = ..., transient_base_bytes: _Optional[int] = ..., transient_per_context_token: _Optional[float] = ..., tool_parser: _Optional[str] = ..., tool_call_start: _Optional[str] = ..., tool_call_end: _Optional[str] = ..., checkpointed: _Optional[bool] = ..., cache_layout: _Optional[str] = ..., max_grammar_bytes: _Optional[int] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("tenant", "token_ids")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tenant: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ProbeResponse(_message.Message):
    __slots__ = ("ram_tokens", "ssd_tokens")
    RAM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SSD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ram_tokens: int
    ssd_tokens: int
    def __init__(self, ram_tokens: _Optional[int] = ..., ssd_tokens: _Optional[int] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("tenant", "session_id", "token_ids", "prefill")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefill: bool
    def __init__(self, tenant: _Optional[str] = ..., session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prefill: _Optional[bool] = ...) -> None: ...

class WorkerLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoadResponse(_message.Message):
    __slots__ = ("running", "waiting", "kv_bytes", "kv_capacity_bytes")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_bytes: int
    kv_capacity_bytes: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., kv_capacity_bytes: _Optional[int] = ...) -> None: ...
