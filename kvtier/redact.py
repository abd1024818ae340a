"""One redaction for everything kvtier shows of its configuration: ``/server_info``, ``/health``,
``/kvtier/stats``, error answers, log lines (``log_setup.py``), the stats line.

Secrets are the passwords of URLs (``redis://:PASSWORD@host``, ``mooncake://...?metadata=
http://user:PASSWORD@host``), the values of secret-looking query parameters (``password=``,
``token=``, ``api_key=``) and the values of configuration fields whose name says key, password,
secret or token. Each is replaced by ``***``; the rest of the text (scheme, user, host) stays, so
an operator can still tell which pool a message is about.
"""

from __future__ import annotations

import re
from typing import Any

# query parameters whose value is a secret (password=, auth_token=, api_key=, ...)
_SECRET_PARAM = re.compile(r"(?i)([?&;][^=&;#\s]*(?:pass|pwd|secret|token|auth|key|cred)[^=&;#\s]*=)[^&;#\s'\"]*")
# a URL's credentials inside free text: scheme://userinfo@ (userinfo up to the last @ before a
# space or a quote, as a password may hold "@ / ? #")
_TEXT_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)([^\s'\"<>]*)@")
# configuration fields whose value is a secret whatever it looks like
_SECRET_NAME = re.compile(r"(?i)(^|_)(password|passwd|pwd|secret|token|api_?key|credentials?)($|_)")
MASK = "***"


def redact_url(url: object) -> str:
    """``url`` fit for an error message, a log line or ``describe()``: the password of
    ``scheme://[user]:password@host`` (or a bare ``secret@host``) and the values of secret-looking
    query parameters (``password=``, ``token=``, ...) replaced by ``***``. Everything up to the
    last ``@`` counts as credentials (a password may hold ``@ / ? #``): a URL with an ``@``
    elsewhere is shown with too much hidden, never with a secret shown."""
    text = url if isinstance(url, str) else str(url)
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    if "@" in rest and not rest.startswith("/"):  # file:///dir@x has no credentials
        userinfo, _, hosts = rest.rpartition("@")
        rest = _userinfo(userinfo) + hosts
    return _SECRET_PARAM.sub(r"\1" + MASK, scheme + sep + rest)


def _userinfo(userinfo: str) -> str:
    user, colon, _ = userinfo.partition(":")
    return f"{user}:{MASK}@" if colon and not set(user) & set("/?#&=") else f"{MASK}@"


def redact_text(text: str) -> str:
    """Free text (a log line, an error message) with every URL's credentials and every
    secret-looking query parameter's value replaced by ``***``."""
    if "@" in text:
        text = _TEXT_CREDENTIALS.sub(lambda m: m.group(1) + _userinfo(m.group(2)), text)
    if "=" in text:
        text = _SECRET_PARAM.sub(r"\1" + MASK, text)
    return text


def redact(value: Any, name: str = "") -> Any:
    """``value`` (a configuration or stats structure: dicts, lists, strings, numbers) with its
    secrets replaced: a string field whose ``name`` says it is a secret entirely, every other
    string by :func:`redact_text`."""
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, name) for v in value]
    if isinstance(value, str):
        if value and _SECRET_NAME.search(name):
            return MASK
        return redact_text(value)
    return value
