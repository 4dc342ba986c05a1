"""Typed errors of the specd client, one per gRPC status code the server uses.

Every failed RPC surfaces as a `SpecdError` subclass carrying the gRPC status
`code` and the server's `details` string (which names the offending field and
its limit for INVALID_ARGUMENT), e.g.

    try:
        client.generate("hi", max_tokens=10**6)
    except InvalidArgument as e:
        print(e.code, e.details)   # StatusCode.INVALID_ARGUMENT  max_tokens must be in [1, 2048] ...

The original `grpc.RpcError` is chained as `__cause__`.
"""
from __future__ import annotations

import grpc


class SpecdError(Exception):
    """A failed specd RPC: `code` (grpc.StatusCode) and the server's `details` string."""

    retryable = False  # whether the client retries this code (only UNAVAILABLE)

    def __init__(self, code: grpc.StatusCode, details: str | None = None, *, method: str | None = None):
        self.code = code
        self.details = details or ""
        self.method = method
        super().__init__(self._message())

    def _message(self) -> str:
        where = f"{self.method}: " if self.method else ""
        return f"{where}{self.code.name}: {self.details}" if self.details else f"{where}{self.code.name}"

    def __reduce__(self):  # picklable despite the keyword-only argument
        return (_rebuild, (type(self), self.code, self.details, self.method))


def _rebuild(cls, code, details, method):
    return cls(code, details, method=method)


class InvalidArgument(SpecdError):
    """INVALID_ARGUMENT: a request field is out of range / malformed (not retried)."""


class NotFound(SpecdError):
    """NOT_FOUND: unknown application (Ray Serve route) or health service name."""


class ResourceExhausted(SpecdError):
    """RESOURCE_EXHAUSTED: the server's admission queue is full (not retried; back off)."""


class Unavailable(SpecdError):
    """UNAVAILABLE: no server/replica reachable; retried by the channel's gRPC retry policy."""

    retryable = True


class DeadlineExceeded(SpecdError):
    """DEADLINE_EXCEEDED: the call's timeout passed (the server aborts the generation)."""


class Cancelled(SpecdError):
    """CANCELLED: the call was cancelled (by the client or the server)."""


class FailedPrecondition(SpecdError):
    """FAILED_PRECONDITION: the server cannot serve this request in its current state."""


class Unimplemented(SpecdError):
    """UNIMPLEMENTED: the server does not implement this RPC (e.g. a direct server without health)."""


class Internal(SpecdError):
    """INTERNAL / UNKNOWN / DATA_LOSS: a server-side bug or crash."""


class Unauthenticated(SpecdError):
    """UNAUTHENTICATED / PERMISSION_DENIED: credentials missing or refused."""


_BY_CODE: dict[grpc.StatusCode, type[SpecdError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.UNKNOWN: Internal,
    grpc.StatusCode.DATA_LOSS: Internal,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: Unauthenticated,
}


def error_class(code: grpc.StatusCode) -> type[SpecdError]:
    """The SpecdError subclass for a status code (SpecdError itself for unmapped codes)."""
    return _BY_CODE.get(code, SpecdError)


def from_rpc_error(err: grpc.RpcError, method: str | None = None) -> SpecdError:
    """Convert a grpc.RpcError (sync or aio) into the matching typed SpecdError."""
    code = err.code() if callable(getattr(err, "code", None)) else None
    details = err.details() if callable(getattr(err, "details", None)) else None
    if not isinstance(code, grpc.StatusCode):
        code, details = grpc.StatusCode.UNKNOWN, details or str(err)
    return error_class(code)(code, details, method=method)
