"""The pieces of `server.origin_guard` and of the API key's sources, on their own."""

from __future__ import annotations

import argparse

import pytest

from server.args import API_KEY_ENV, resolve_api_keys
from server.handlers import is_json
from server.origin_guard import host_name, is_loopback


@pytest.mark.parametrize(("host", "loopback"), [
    ("localhost", True), ("LOCALHOST.", True), ("a.localhost", True), ("127.0.0.1", True),
    ("127.255.0.9", True), ("::1", True), ("[::1]", True), ("0.0.0.0", False), ("::", False),
    ("evil.test", False), ("localhost.evil.test", False), ("192.168.1.2", False), ("", False),
])
def test_loopback_names(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(("header", "name"), [
    ("localhost:8000", "localhost"), ("[::1]:8000", "::1"), ("[::1]", "::1"), ("::1", "::1"),
    ("evil.test", "evil.test"),
])
def test_host_header_names(header: str, name: str) -> None:
    assert host_name(header) == name


@pytest.mark.parametrize(("content_type", "json"), [
    ("application/json", True), ("Application/JSON; charset=utf-8", True),
    ("application/merge-patch+json", True), ("text/plain", False), ("text/json", False),
    ("application/x-www-form-urlencoded", False), ("", False),
])
def test_json_media_types(content_type: str, json: bool) -> None:
    assert is_json(content_type) is json


def test_the_api_key_comes_from_a_file_the_flag_or_the_environment(tmp_path, monkeypatch) -> None:
    def args(**kw) -> argparse.Namespace:
        return argparse.Namespace(**({"api_key": None, "api_key_file": None} | kw))

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_keys(args()) == ()
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_keys(args()) == ("from-env",)
    assert resolve_api_keys(args(api_key=["from-flag", "b"])) == ("from-flag", "b")
    key = tmp_path / "key"
    key.write_text("from-file\n\nsecond\n")  # one key a line
    assert resolve_api_keys(args(api_key=["x"], api_key_file=str(key))) == ("from-file", "second")
    key.write_text("\n")
    with pytest.raises(OSError, match="holds no key"):
        resolve_api_keys(args(api_key_file=str(key)))
