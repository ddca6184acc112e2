"""Recognising the gate's AdmissionError family without importing gate/ (duck typing).

Seam 1: an admission error carries `status`, `code`, `message` and `retry_after`;
`error_type`, when present, becomes the error's `type`.
`ReplicaUnavailable` (by class name anywhere in its MRO, or code
`replica_unavailable`) asks the proxy to re-route once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionRefusal:
    status: int
    code: str
    message: str
    retry_after: float | None
    replica_unavailable: bool
    error_type: str | None = None


def as_refusal(exc: BaseException) -> AdmissionRefusal | None:
    """The refusal an admission exception stands for, or None if it is not one."""
    status = getattr(exc, "status", None)
    if not isinstance(status, int) or isinstance(status, bool):
        return None
    code = getattr(exc, "code", None) or "admission_refused"
    message = getattr(exc, "message", None) or str(exc) or code
    retry_after = getattr(exc, "retry_after", None)
    unavailable = code == "replica_unavailable" or any(
        cls.__name__ == "ReplicaUnavailable" for cls in type(exc).__mro__
    )
    error_type = getattr(exc, "error_type", None)
    return AdmissionRefusal(
        status,
        str(code),
        str(message),
        float(retry_after) if isinstance(retry_after, (int, float)) else None,
        unavailable,
        error_type if isinstance(error_type, str) else None,
    )
