"""Kubernetes-style API errors, rendered as `meta/v1 Status` objects."""

from __future__ import annotations

from typing import Any

_REASONS = {
    400: "BadRequest",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    500: "InternalError",
}


class ApiError(Exception):
    """An error the emulator answers with: HTTP `code` plus a `Status` body."""

    def __init__(
        self, code: int, message: str, *, reason: str | None = None, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or _REASONS.get(code, "Unknown")
        self.details = details or {}

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body


def _details(resource: str, name: str, group: str) -> dict[str, Any]:
    return {"name": name, "group": group, "kind": resource}


def not_found(resource: str, name: str, group: str = "") -> ApiError:
    qualified = f"{resource}.{group}" if group else resource
    return ApiError(404, f'{qualified} "{name}" not found', details=_details(resource, name, group))


def already_exists(resource: str, name: str, group: str = "") -> ApiError:
    qualified = f"{resource}.{group}" if group else resource
    return ApiError(
        409,
        f'{qualified} "{name}" already exists',
        reason="AlreadyExists",
        details=_details(resource, name, group),
    )


def conflict(resource: str, name: str, group: str = "") -> ApiError:
    qualified = f"{resource}.{group}" if group else resource
    message = (
        f'Operation cannot be fulfilled on {qualified} "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again"
    )
    return ApiError(409, message, reason="Conflict", details=_details(resource, name, group))


def invalid(message: str) -> ApiError:
    return ApiError(422, message, reason="Invalid")


def bad_request(message: str) -> ApiError:
    return ApiError(400, message, reason="BadRequest")


def method_not_allowed(
    message: str = "the server does not allow this method on the requested resource",
) -> ApiError:
    return ApiError(405, message, reason="MethodNotAllowed")
