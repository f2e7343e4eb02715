"""How a Marduk process proves who it is to NATS: the credentials every process takes.

NATS's own mechanisms, nothing of ours (decisions.md #10): an nkey seed file (``--nkey`` /
MARDUK_NKEY, what ``marduk auth init`` writes), a decentralized-auth creds file (``--creds`` /
MARDUK_CREDS), user and password or a token (in the URL, or MARDUK_USER / MARDUK_PASSWORD /
MARDUK_TOKEN), and TLS (``--tls-ca``, ``--tls-cert``, ``--tls-key`` / MARDUK_TLS_*).

Secrets never reach a log, an error message or a process's arguments: ``redact`` strips them
from URLs, and files are passed by path.
"""

from __future__ import annotations

import os
import re
import ssl
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from marduk.errors import MardukError


class CredentialsError(MardukError):
    """Credentials that cannot be used (a missing file, a bad combination)."""


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a process presents to the NATS server. All optional: none means anonymous."""

    nkey: Path | None = None
    """nkey seed file (``SU...``), as ``marduk auth init`` writes and ``nats --nkey`` reads."""
    creds: Path | None = None
    """NATS decentralized-auth credentials file (a user JWT and its seed)."""
    user: str | None = None
    password: str | None = None
    token: str | None = None
    tls_ca: Path | None = None
    """CA bundle to verify the server's certificate (turns TLS on)."""
    tls_cert: Path | None = None
    """Client certificate, for servers that verify clients (with ``tls_key``)."""
    tls_key: Path | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **given: Any) -> Credentials:
        """Arguments first, then MARDUK_* variables (the library's and supervisor's path)."""
        env = dict(os.environ) if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = given.get(f.name)
            if value in (None, ""):
                value = env.get(f"MARDUK_{f.name.upper()}") or None
            if value is not None and f.name in _PATHS:
                value = Path(value)
            values[f.name] = value
        return cls(**values)

    @property
    def identity(self) -> str | None:
        """The identity's name (its key file's stem, e.g. ``agent-big``), or None.

        It names the connection's reply inbox prefix, ``_INBOX.<identity>.``, which the
        generated server configuration lets only that identity read.
        """
        path = self.nkey or self.creds
        if path is None:
            return None
        name = re.sub(r"[^A-Za-z0-9_-]", "_", path.stem)
        return name or None

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))

    def check(self) -> None:
        """Raise CredentialsError (one clear line) if a named file is missing or unreadable."""
        if self.nkey and self.creds:
            raise CredentialsError("give --nkey or --creds, not both")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise CredentialsError("--tls-cert and --tls-key go together")
        for name in _PATHS:
            path = getattr(self, name)
            if path is not None and not os.access(path, os.R_OK):
                flag = "--" + name.replace("_", "-")
                raise CredentialsError(f"{flag} {path}: no such readable file")
        if self.nkey is not None:
            import nkeys

            try:
                nkeys.from_seed(bytearray(self.nkey.read_bytes().strip())).wipe()
            except Exception:
                raise CredentialsError(
                    f"--nkey {self.nkey}: not an nkey seed (SU...); `marduk auth init` writes them"
                ) from None

    def nats_options(self) -> dict[str, Any]:
        """Keyword arguments for nats-py's ``connect``."""
        self.check()
        opts: dict[str, Any] = {}
        if self.nkey:
            # The seed itself, read once: nats-py given the file reads the public key at
            # connect but signs every reconnect with the file's seed of the moment, so after a
            # rotation it would present one key and sign with another, refused forever. Held in
            # memory, a connection keeps its key (valid until the rotation is finished).
            opts["nkeys_seed_str"] = self.nkey.read_text().strip()
        if self.creds:
            opts["user_credentials"] = str(self.creds)
        if self.user:
            opts["user"] = self.user
        if self.password:
            opts["password"] = self.password
        if self.token:
            opts["token"] = self.token
        if self.tls_ca or self.tls_cert:
            ctx = ssl.create_default_context(cafile=str(self.tls_ca) if self.tls_ca else None)
            if self.tls_cert and self.tls_key:
                ctx.load_cert_chain(str(self.tls_cert), str(self.tls_key))
            opts["tls"] = ctx
        return opts

    def describe(self) -> str:
        """What is presented, without any secret: for logs."""
        parts = []
        if self.nkey:
            parts.append(f"nkey {self.nkey}")
        if self.creds:
            parts.append(f"creds {self.creds}")
        if self.user:
            parts.append(f"user {self.user}")
        if self.token:
            parts.append("a token")
        if self.tls_ca or self.tls_cert:
            parts.append("TLS")
        return ", ".join(parts) or "no credentials"


_PATHS = ("nkey", "creds", "tls_ca", "tls_cert", "tls_key")


def redact(addr: str) -> str:
    """``addr`` (one URL or a comma-separated list) without passwords or tokens."""
    return ",".join(_redact_one(u.strip()) for u in addr.split(","))


def _redact_one(url: str) -> str:
    try:
        parts = urlsplit(url if "://" in url else "nats://" + url)
    except ValueError:
        return "<unparsable address>"
    if not parts.username and not parts.password:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port:
        host += f":{parts.port}"
    user = parts.username if parts.password else "***"  # a lone token is the secret
    userinfo = f"{user}:***" if parts.password else user
    return urlunsplit((parts.scheme, f"{userinfo}@{host}", parts.path, parts.query, ""))
