"""Typed exceptions of the engine API client.

Every refusal of the worker is a gRPC status whose `grpc-status-details-bin` trailer is an encoded
`tandem.engine.v1.Error` (engine.proto, "Errors"); `from_rpc_error` turns it into the subclass of
`ApiError` named after its `ErrorReason` (e.g. `IdentityMismatch`, `TierUnavailable`). A status
without a typed error is a transport-level failure: `WorkerUnavailable` (cannot connect, connection
lost: the worker is down or restarting) or `CallTimeout` (the client's deadline passed before any
answer). Pool claiming and mapping failures are `PoolsError`.
"""

from __future__ import annotations

import grpc

REASON_METADATA = "tandem-error-reason"
DETAILS_METADATA = "grpc-status-details-bin"


class TandemError(Exception):
    """Base of every error this package raises."""


class WorkerUnavailable(TandemError):
    """The worker could not be reached (not running, restarting, socket missing, connection lost)."""


class CallTimeout(TandemError):
    """The call's client-side deadline passed without a typed answer from the worker."""


class PoolsError(TandemError):
    """Claiming the pool fds on the pools socket, or mapping them, failed.

    `reason` is the worker's reason name when it refused the claim (`ALREADY_CLAIMED`,
    `NOT_ATTACHED`, `MALFORMED`), else empty.
    """

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


class ApiError(TandemError):
    """A typed refusal of the worker.

    Attributes: `reason` (the `ErrorReason` name, e.g. "IDENTITY_MISMATCH"), `code` (the
    `grpc.StatusCode`), `message`, and for identity/domain mismatches `field`, `ours` (the worker's
    value) and `theirs` (the engine's value).
    """

    reason = "ERROR_REASON_UNSPECIFIED"

    def __init__(self, code, reason: str, message: str, field: str = "", ours: str = "", theirs: str = ""):
        detail = f"{reason} ({code.name if code else '?'}): {message}"
        if field:
            detail += f" [field {field}" + (f": ours {ours!r}, theirs {theirs!r}]" if ours or theirs else "]")
        super().__init__(detail)
        self.code = code
        self.reason = reason
        self.message = message
        self.field = field
        self.ours = ours
        self.theirs = theirs


def _sub(name: str, doc: str):
    cls = type(name, (ApiError,), {"__doc__": doc})
    return cls


# One class per ErrorReason of engine.proto (the gRPC code that carries it in brackets).
Malformed = _sub("Malformed", "A field is missing, zero or out of range [INVALID_ARGUMENT].")
PageOutOfRange = _sub("PageOutOfRange", "A page index is outside the pools or listed twice.")
LayerOutOfRange = _sub("LayerOutOfRange", "A layer range is empty or leaves [0, layers).")
IdentityMismatch = _sub("IdentityMismatch", "The engine's identity differs from the worker's config; nothing allocated.")
PoolNotConfigured = _sub("PoolNotConfigured", "A pool asked for is not configured on this worker.")
PoolDomainMismatch = _sub("PoolDomainMismatch", "A pool lies outside the configured allocator domain.")
PoolRegistrationFailed = _sub("PoolRegistrationFailed", "Registering a pool with L3 failed under failClosed.")
PoolAllocationFailed = _sub("PoolAllocationFailed", "Allocating a pool failed [RESOURCE_EXHAUSTED].")
AdoptionUnsupported = _sub("AdoptionUnsupported", "The worker allocates every pool; engine memory is refused.")
AlreadyAttached = _sub("AlreadyAttached", "Another engine is attached [ALREADY_EXISTS].")
NotAttached = _sub("NotAttached", "The attach id is unknown, detached or not current: attach again.")
AlreadyClaimed = _sub("AlreadyClaimed", "The attach's fds were already claimed.")
NoFreePages = _sub("NoFreePages", "Not enough free pages now; retry after release events.")
ExceedsPool = _sub("ExceedsPool", "More pages than the pool has in total.")
UnknownRoom = _sub("UnknownRoom", "The room is unknown to this worker.")
RoomState = _sub("RoomState", "The call is not allowed in the room's state.")
DeadlineExceeded = _sub("DeadlineExceeded", "The worker answered that the call's deadline passed.")
WrongRole = _sub("WrongRole", "The call needs a role this worker does not have.")
TierUnavailable = _sub("TierUnavailable", "No cache tier is configured or wired for this worker.")
SpecStepInvalid = _sub("SpecStepInvalid", "A speculative step is malformed.")
ShuttingDown = _sub("ShuttingDown", "The worker is shutting down.")
Internal = _sub("Internal", "An unexpected internal failure of the worker.")
GroupBroken = _sub("GroupBroken", "LayerSplit: the CP group's rank link is broken [UNAVAILABLE].")

BY_REASON = {
    "MALFORMED": Malformed,
    "PAGE_OUT_OF_RANGE": PageOutOfRange,
    "LAYER_OUT_OF_RANGE": LayerOutOfRange,
    "IDENTITY_MISMATCH": IdentityMismatch,
    "POOL_NOT_CONFIGURED": PoolNotConfigured,
    "POOL_DOMAIN_MISMATCH": PoolDomainMismatch,
    "POOL_REGISTRATION_FAILED": PoolRegistrationFailed,
    "POOL_ALLOCATION_FAILED": PoolAllocationFailed,
    "ADOPTION_UNSUPPORTED": AdoptionUnsupported,
    "ALREADY_ATTACHED": AlreadyAttached,
    "NOT_ATTACHED": NotAttached,
    "ALREADY_CLAIMED": AlreadyClaimed,
    "NO_FREE_PAGES": NoFreePages,
    "EXCEEDS_POOL": ExceedsPool,
    "UNKNOWN_ROOM": UnknownRoom,
    "ROOM_STATE": RoomState,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
    "WRONG_ROLE": WrongRole,
    "TIER_UNAVAILABLE": TierUnavailable,
    "SPEC_STEP_INVALID": SpecStepInvalid,
    "SHUTTING_DOWN": ShuttingDown,
    "INTERNAL": Internal,
    "GROUP_BROKEN": GroupBroken,
}


def from_rpc_error(err: grpc.RpcError, what: str = "call") -> TandemError:
    """Maps a failed call to a typed exception (see the module docstring).

    A reason this client does not know (a newer worker) becomes a plain `ApiError` with its name.
    """
    from ._pb import engine_pb2 as pb

    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    meta = dict(trailing or ())
    raw = meta.get(DETAILS_METADATA)
    if raw:
        e = pb.Error()
        try:
            e.ParseFromString(raw)
        except Exception:  # a details blob that is not ours: fall through to the code
            e = None
        if e is not None and e.reason != 0:
            try:
                name = pb.ErrorReason.Name(e.reason)
            except ValueError:
                name = meta.get(REASON_METADATA, f"REASON_{e.reason}")
            cls = BY_REASON.get(name, ApiError)
            return cls(code, name, e.message, e.field, e.ours, e.theirs)
    name = meta.get(REASON_METADATA)
    if isinstance(name, str) and name in BY_REASON:
        return BY_REASON[name](code, name, details or "")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return CallTimeout(f"{what}: no answer within the deadline ({details})")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return WorkerUnavailable(f"{what}: worker unavailable ({code.name}: {details})")
    return ApiError(code, "ERROR_REASON_UNSPECIFIED", f"{what}: {details}")
