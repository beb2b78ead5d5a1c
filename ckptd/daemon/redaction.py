"""Credentials never reach the daemon's log, at any level.

botocore logs every request it signs at debug level (headers with ``Authorization: AWS4-HMAC-SHA256
Credential=<key id>/...``, presigned query strings with ``X-Amz-Signature``), aiohttp logs what it is told,
and an error text may quote a URL. :class:`RedactingFilter` sits on every handler of the root logger (so
every logger's records pass it, botocore's, s3fs's, aiobotocore's and aiohttp's included) and rewrites a
record's message and traceback text before any handler formats it:

- the values of ``Authorization`` headers, ``Bearer`` tokens, ``X-Amz-Signature`` / ``Signature``,
  ``X-Amz-Credential`` / ``Credential``, ``X-Amz-Security-Token``, and ``key`` / ``secret`` / ``token`` /
  ``password`` / ``aws_secret_access_key`` / ``aws_access_key_id`` / ``aws_session_token`` fields of dicts
  and query strings;
- every known secret wherever it appears: the peer token, credentials in a root's ``storage_options`` and
  the ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN`` of the environment.

Each is replaced by :data:`REDACTED`. :func:`install_redaction` adds the filter.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

#: What a removed credential reads as.
REDACTED = "<redacted>"
_SECRET_FIELDS = ("authorization", "x-amz-signature", "signature", "x-amz-credential", "credential",
                  "x-amz-security-token", "aws_secret_access_key", "aws_access_key_id", "aws_session_token",
                  "secret_access_key", "access_key_id", "session_token", "secret", "token", "password", "key",
                  "peer_token")
_FIELD = "|".join(re.escape(name) for name in sorted(_SECRET_FIELDS, key=len, reverse=True))
_PATTERNS = (
    # 'Authorization': b'AWS4-HMAC-SHA256 Credential=...'  /  "token": "..."  (dict reprs, JSON)
    re.compile(rf"""(?i)(['"]?(?:{_FIELD})['"]?\s*[:=]\s*b?)(['"])(.*?)(\2)"""),
    # Authorization: AWS4-HMAC-SHA256 ...  (a header line, to its end)
    re.compile(r"(?i)(\b(?:authorization|x-amz-security-token)\s*:\s*)()([^\r\n'\"]+)()"),
    # X-Amz-Signature=abc&...  /  Credential=AKID/...,  (query strings, header values)
    re.compile(rf"(?i)(\b(?:{_FIELD})=)()([^&\s,'\"]+)()"),
    re.compile(r"(?i)(\bbearer\s+)()([^\s,'\"]+)()"),
)
_MIN_SECRET_CHARS = 4
_ENV_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "CKPTD_PEER_TOKEN")


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without credentials (see the module docstring)."""
    for secret in sorted({value for value in secrets if len(value) >= _MIN_SECRET_CHARS}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    for pattern in _PATTERNS:
        text = pattern.sub(lambda match: f"{match.group(1)}{match.group(2)}{REDACTED}{match.group(4)}", text)
    return text


class RedactingFilter(logging.Filter):
    """Rewrites each record's message (and traceback text) without credentials; never drops a record."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = tuple(secrets)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose arguments do not fit its format: show it raw
            message = f"{record.msg!r} {record.args!r}"
        record.msg, record.args = redact(message, self.secrets), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text, self.secrets)
        if record.stack_info:
            record.stack_info = redact(record.stack_info, self.secrets)
        return True


def known_secrets(peer_token: str | None, storage_options: Iterable[Mapping[str, Any]],
                  environ: Mapping[str, str] | None = None) -> list[str]:
    """The secrets the daemon knows of: its peer token, credential values of ``storage_options`` (nested
    tables included) and the credential variables of ``environ``."""
    environ = os.environ if environ is None else environ
    found = [peer_token] if peer_token else []
    found += [environ[name] for name in _ENV_SECRETS if environ.get(name)]

    def walk(options: Mapping[str, Any]) -> None:
        for name, value in options.items():
            if isinstance(value, Mapping):
                walk(value)
            elif isinstance(value, str) and str(name).lower() in _SECRET_FIELDS:
                found.append(value)

    for options in storage_options:
        walk(options)
    return found


def install_redaction(secrets: Iterable[str] = (), logger: logging.Logger | None = None) -> RedactingFilter:
    """Add a :class:`RedactingFilter` to every handler of ``logger`` (default: the root logger); returns it."""
    target = logger or logging.getLogger()
    redacting = RedactingFilter(secrets)
    for handler in target.handlers:
        handler.addFilter(redacting)
    return redacting


__all__ = ["REDACTED", "RedactingFilter", "install_redaction", "known_secrets", "redact"]
