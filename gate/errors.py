"""Why an acquire did not return a lease: the errors the proxy turns into responses.

Every `AdmissionError` carries what the proxy needs for an OpenAI-shaped error
(`{"error": {"message", "type", "code"}}`): `status`, `code`, `error_type`,
`message`, and `retry_after` (seconds for the Retry-After header, or None).
"""

from __future__ import annotations


class AdmissionError(Exception):
    status: int = 503
    code: str = "admission_error"
    error_type: str = "server_error"

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class AdmissionSuperseded(AdmissionError):
    """A newer attempt of the same session arrived while this one waited (409)."""

    status = 409
    code = "admission_superseded"
    error_type = "conflict_error"


class AdmissionTimeout(AdmissionError):
    """The request waited gate.max_wait_sec without being admitted (503 + Retry-After)."""

    status = 503
    code = "admission_timeout"
    error_type = "server_error"


class PromptTooLong(AdmissionError):
    """The prompt can never be served by the replica: it cannot fit its KV cache (working_set
    policy) or is longer than its max_model_len (400)."""

    status = 400
    code = "prompt_too_long"
    error_type = "invalid_request_error"


class ReplicaUnavailable(AdmissionError):
    """The replica was removed while the request waited; re-route it (else 503)."""

    status = 503
    code = "replica_unavailable"
    error_type = "server_error"


class SessionRelocated(AdmissionError):
    """The held turn moves to `replica`, which has nothing to do (`gate/relocation.py`): the
    caller acquires it there. Raised only to a caller that offered other replicas."""

    status = 503
    code = "session_relocated"
    error_type = "server_error"

    def __init__(self, replica: str) -> None:
        super().__init__(f"the turn moved to replica {replica}, which has nothing in flight or waiting")
        self.replica = replica
