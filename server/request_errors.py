"""The 400s of request validation: `ProtocolError` (the app answers it in the OpenAI error shape)
and the check that refuses fields the server does not implement."""

from __future__ import annotations


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


def check_fields(body: dict, allowed: frozenset[str], where: str = "") -> None:
    """400 on the first present field that is not in `allowed` (null counts as absent)."""
    for name, value in body.items():
        if name not in allowed and value is not None:
            field = f"{where}.{name}" if where else name
            raise ProtocolError(f"'{field[:64]}' is not supported by this server", field[:64])
