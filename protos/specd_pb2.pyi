from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_ABORT: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "num_beams", "length_penalty", "early_stopping", "ignore_eos", "logprobs", "grammar", "presence_penalty", "frequency_penalty", "repetition_penalty")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_BEAMS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    num_beams: int
    length_penalty: float
    early_stopping: bool
    ignore_eos: bool
    logprobs: int
    grammar: Grammar
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., num_beams: _Optional[int] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("draft", "gamma", "gamma_auto", "tree", "threshold", "entropy_gate", "acceptance")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    GAMMA_AUTO_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_GATE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    draft: str
    gamma: int
    gamma_auto: bool
    tree: int
    threshold: float
    entropy_gate: float
    acceptance: str
    def __init__(self, draft: _Optional[str] = ..., gamma: _Optional[int] = ..., gamma_auto: _Optional[bool] = ..., tree: _Optional[int] = ..., threshold: _Optional[float] = ..., entropy_gate: _Optional[float] = ..., acceptance: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "messages", "token_ids", "sampling", "speculation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    messages: ChatMessages
    token_ids: TokenIds
    sampling: SamplingParams
    speculation: SpeculationParams
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationParams, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class SpecStats(_message.Message):
    __slots__ = ("drafts", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "acceptance_per_position", "target_passes", "draft_seconds", "verify_seconds")
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    TARGET_PASSES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    acceptance_per_position: _containers.RepeatedScalarFieldContainer[float]
    target_passes: int
    draft_seconds: float
    verify_seconds: float
    def __init__(self, drafts: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., acceptance_per_position: _Optional[_Iterable[float]] = ..., target_passes: _Optional[int] = ..., draft_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "usage", "spec_stats", "coalesced", "stop_string", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPEC_STATS_FIELD_NUMBER: _ClassVar[int]
    COALESCED_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    spec_stats: SpecStats
    coalesced: bool
    stop_string: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., spec_stats: _Optional[_Union[SpecStats, _Mapping]] = ..., coalesced: _Optional[bool] = ..., stop_string: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaLoad(_message.Message):
    __slots__ = ("replica_id", "running", "waiting", "kv_slots_in_use", "kv_slots_total", "draft_kv_slots_in_use", "recent_acceptance", "kv_blocks_free", "kv_blocks_total")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_SLOTS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    RECENT_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    running: int
    waiting: int
    kv_slots_in_use: int
    kv_slots_total: int
    draft_kv_slots_in_use: int
    recent_acceptance: float
    kv_blocks_free: int
    kv_blocks_total: int
    def __init__(self, replica_id: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_slots_in_use: _Optional[int] = ..., kv_slots_total: _Optional[int] = ..., draft_kv_slots_in_use: _Optional[int] = ..., recent_acceptance: _Optional[float] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaLoad]
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaLoad, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStats(_message.Message):
    __slots__ = ("replica_id", "role", "active_sequences", "kv_slots_in_use", "kv_slots_total", "dtype", "dtype_reason", "hardware", "policy", "prepacked", "cpu_paths", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_requests", "prefix_cache_hit_requests", "prefix_cache_slots", "exact", "exact_reason", "kv_blocks_free", "kv_blocks_total", "kv_block_size", "kv_bytes_reserved", "kv_bytes_used", "preemptions", "rss_bytes", "weights_bytes")
    class CpuPathsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_REASON_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PREPACKED_FIELD_NUMBER: _ClassVar[int]
    CPU_PATHS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    EXACT_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RESERVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    role: str
    active_sequences: int
    kv_slots_in_use: int
    kv_slots_total: int
    dtype: str
    dtype_reason: str
    hardware: str
    policy: _containers.RepeatedCompositeFieldContainer[DraftPolicy]
    prepacked: bool
    cpu_paths: _containers.ScalarMap[str, str]
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_requests: int
    prefix_cache_hit_requests: int
    prefix_cache_slots: int
    exact: bool
    exact_reason: str
    kv_blocks_free: int
    kv_blocks_total: int
    kv_block_size: int
    kv_bytes_reserved: int
    kv_bytes_used: int
    preemptions: int
    rss_bytes: int
    weights_bytes: int
    def __init__(self, replica_id: _Optional[str] = ..., role: _Optional[str] = ..., active_sequences: _Optional[int] = ..., kv_slots_in_use: _Optional[int] = ..., kv_slots_total: _Optional[int] = ..., dtype: _Optional[str] = ..., dtype_reason: _Optional[str] = ..., hardware: _Optional[str] = ..., policy: _Optional[_Iterable[_Union[DraftPolicy, _Mapping]]] = ..., prepacked: _Optional[bool] = ..., cpu_paths: _Optional[_Mapping[str, str]] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_requests: _Optional[int] = ..., prefix_cache_hit_requests: _Optional[int] = ..., prefix_cache_slots: _Optional[int] = ..., exact: _Optional[bool] = ..., exact_reason: _Optional[str] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., kv_bytes_reserved: _Optional[int] = ..., kv_bytes_used: _Optional[int] = ..., preemptions: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., weights_bytes: _Optional[int] = ...) -> None: ...

class DraftPolicy(_message.Message):
    __slots__ = ("draft", "gamma", "speculated_share", "acceptance", "steps", "speculated_steps")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    SPECULATED_SHARE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SPECULATED_STEPS_FIELD_NUMBER: _ClassVar[int]
    draft: str
    gamma: int
    speculated_share: float
    acceptance: _containers.RepeatedScalarFieldContainer[float]
    steps: int
    speculated_steps: int
    def __init__(self, draft: _Optional[str] = ..., gamma: _Optional[int] = ..., speculated_share: _Optional[float] = ..., acceptance: _Optional[_Iterable[float]] = ..., steps: _Optional[int] = ..., speculated_steps: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("requests_total", "requests_active", "requests_queued", "coalesced_total", "rejected_total", "tokens_total", "spec_stats", "replicas", "failovers_total", "uptime_seconds")
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    COALESCED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REJECTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEC_STATS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    requests_total: int
    requests_active: int
    requests_queued: int
    coalesced_total: int
    rejected_total: int
    tokens_total: int
    spec_stats: SpecStats
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStats]
    failovers_total: int
    uptime_seconds: float
    def __init__(self, requests_total: _Optional[int] = ..., requests_active: _Optional[int] = ..., requests_queued: _Optional[int] = ..., coalesced_total: _Optional[int] = ..., rejected_total: _Optional[int] = ..., tokens_total: _Optional[int] = ..., spec_stats: _Optional[_Union[SpecStats, _Mapping]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStats, _Mapping]]] = ..., failovers_total: _Optional[int] = ..., uptime_seconds: _Optional[float] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("name", "kind", "default", "default_gamma", "default_gamma_auto", "placement")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_GAMMA_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_GAMMA_AUTO_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    default: bool
    default_gamma: int
    default_gamma_auto: bool
    placement: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., default: _Optional[bool] = ..., default_gamma: _Optional[int] = ..., default_gamma_auto: _Optional[bool] = ..., placement: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("target", "drafts", "max_gamma", "max_tokens", "context_length", "max_beams")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    MAX_GAMMA_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_BEAMS_FIELD_NUMBER: _ClassVar[int]
    target: str
    drafts: _containers.RepeatedCompositeFieldContainer[DraftInfo]
    max_gamma: int
    max_tokens: int
    context_length: int
    max_beams: int
    def __init__(self, target: _Optional[str] = ..., drafts: _Optional[_Iterable[_Union[DraftInfo, _Mapping]]] = ..., max_gamma: _Optional[int] = ..., max_tokens: _Optional[int] = ..., context_length: _Optional[int] = ..., max_beams: _Optional[int] = ...) -> None: ...
