"""Client SDK of the specd speculative-decoding serving cluster (gRPC, specd.v1.SpecDecode).

    from specd_client import SpecdClient
    with SpecdClient("localhost:9000") as client:
        print(client.generate("Hello", max_tokens=32).text)

`SpecdClient` (blocking) and `AsyncSpecdClient` (asyncio) share one surface:
generate, stream, abort, health, is_healthy, stats, load, list_models, close. Failed calls
raise typed `SpecdError` subclasses (specd_client.errors); UNAVAILABLE is retried
by gRPC's own retry policy (up to MAX_RETRIES re-attempts). Importing this package
pulls in only grpcio, protobuf, grpcio-health-checking, the stdlib and the
generated stubs in `protos` (no torch, ray, transformers or numpy).

Installable alone as the `specd-client` distribution (sdk/pyproject.toml).
"""
from .client import (
                     HEALTH_SERVICE,
                     MAX_RETRIES,
                     AsyncSpecdClient,
                     Chunk,
                     DraftInfo,
                     ModelsInfo,
                     ReplicaLoad,
                     ReplicaStats,
                     Result,
                     SpecdClient,
                     Stats,
                     TokenLogprob,
                     Usage,
                     build_request,
)
from .errors import (
                     Cancelled,
                     DeadlineExceeded,
                     FailedPrecondition,
                     Internal,
                     InvalidArgument,
                     NotFound,
                     ResourceExhausted,
                     SpecdError,
                     Unauthenticated,
                     Unavailable,
                     Unimplemented,
)

__all__ = [
    "SpecdClient", "AsyncSpecdClient", "Result", "Chunk", "Usage", "Stats", "ReplicaStats", "ReplicaLoad", "ModelsInfo",
    "DraftInfo", "TokenLogprob", "HEALTH_SERVICE", "MAX_RETRIES", "build_request",
    "SpecdError", "InvalidArgument", "NotFound", "ResourceExhausted", "Unavailable", "DeadlineExceeded",
    "Cancelled", "FailedPrecondition", "Unimplemented", "Internal", "Unauthenticated",
]
