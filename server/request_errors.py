"""The 400s of request validation: `ProtocolError` (the app answers it in the OpenAI error shape)
and the check that refuses fields the server does not implement."""

from __future__ import annotations

import json


class ProtocolError(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = (
            message,
            param,
            status,
            kind,
            code,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def check_defaults(body: dict, defaults: dict[str, object], where: str = "") -> None:
    """400 on the first of `defaults` present with another value: fields accepted only where they
    ask for what the server does anyway."""
    for name, default in defaults.items():
        value = body.get(name)
        if value is not None and (type(value) is not type(default) or value != default):
            field = f"{where}.{name}" if where else name
            got = json.dumps(value)[:40]
            raise ProtocolError(f"'{field}' is only supported as {json.dumps(default)}, got {got}",
                                field)


def check_fields(body: dict, allowed: frozenset[str], where: str = "") -> None:
    """400 on the first present field that is not in `allowed` (null counts as absent)."""
    for name, value in body.items():
        if name not in allowed and value is not None:
            field = f"{where}.{name}" if where else name
            raise ProtocolError(f"'{field[:64]}' is not supported by this server", field[:64])
