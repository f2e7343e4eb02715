"""Identities, permissions and command signatures, on NATS's own security model.

``marduk auth init DIR`` makes one nkey identity per role and a nats-server configuration that
grants each role only what it needs under the prefix (decisions.md #10):

* ``controller``: everything Marduk uses (its subjects, JetStream, replies);
* ``agent``: request ``<job>.register|deregister|ack|report|request|params.applied``, publish
  ``<job>.perf``, subscribe to command subjects (``<job>.cmd.>``: parameters too) and
  ``ctl.hello``, and its own reply inboxes: it cannot publish commands, health, hello, queries
  or parameters;
  ``add-agent --job NAME`` makes one valid for one job only;
* ``monitor``: publish health events (and see the stream's ``health.stored`` notices and
  receive the controller's decision);
* ``admin``: what ``marduk monitor`` does: health, query, forget, drain, perf, live parameters
  (``ctl.params.set``: no other role may set them), and watching events.

Files in DIR: ``<name>.nk`` (the seed, mode 0600, what nats-py's ``nkeys_seed=`` and the ``nats``
CLI's ``--nkey`` read), ``controller.pub`` (the controller's public key: agents verify command
signatures with it), ``identities.json`` (who exists), ``nats-server.conf`` (generated from it;
``include`` it from an existing server's configuration).

Commands carry the controller's signature: an ed25519 signature by its nkey over the exact
payload, in the header ``Marduk-Sig`` (base64). Agents given the controller's public key drop
commands that are unsigned or signed by anyone else.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import nkeys

from marduk.errors import MardukError
from marduk.wire.subjects import DEFAULT_PREFIX, check_job

if TYPE_CHECKING:
    import nacl.signing

SIG_HEADER = "Marduk-Sig"
ROLES = ("controller", "agent", "monitor", "admin")
CONFIG_FILE = "nats-server.conf"
IDENTITIES_FILE = "identities.json"
CONTROLLER_PUB = "controller.pub"


class AuthError(MardukError):
    """An auth directory or key that cannot be used; the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class Identity:
    name: str  # the seed file is <name>.nk
    role: str
    public_key: str
    job: str | None = None  # agents only: valid for this job's subjects alone
    # The key this identity had before ``rotate``: still accepted (same permissions) until
    # ``rotate --finish`` or the next rotate, so holders keep working until they restart.
    previous: str | None = None


# --- keys ----------------------------------------------------------------------------------------


def new_user_seed() -> bytes:
    return bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))


def read_seed(path: Path) -> bytes:
    try:
        seed = path.read_bytes().strip()
        nkeys.from_seed(bytearray(seed))
    except OSError as e:
        raise AuthError(f"cannot read nkey seed {path}: {e.strerror or e}") from None
    except Exception:
        raise AuthError(f"{path} does not hold an nkey seed (SU...)") from None
    return seed


def public_key_of(seed: bytes) -> str:
    return bytes(nkeys.from_seed(bytearray(seed)).public_key).decode()


def sign(seed: bytes, data: bytes) -> str:
    """The value of the ``Marduk-Sig`` header for ``data``."""
    kp = nkeys.from_seed(bytearray(seed))
    try:
        return base64.b64encode(kp.sign(data)).decode()
    finally:
        kp.wipe()


class Signer:
    """``sign`` with one seed, its key pair made once. ``sign`` makes the key pair again on
    every call (decodes the seed, expands the ed25519 key): half of its ~60 us, which every
    command the controller publishes would pay on its way out. The key lives as long as the
    seed it comes from (the controller holds both while it runs)."""

    def __init__(self, seed: bytes) -> None:
        self.seed = seed
        self._kp = nkeys.from_seed(bytearray(seed))

    def sign(self, data: bytes) -> str:
        """The value of the ``Marduk-Sig`` header for ``data`` (the same as ``sign``'s)."""
        return base64.b64encode(self._kp.sign(data)).decode()


def verify(public_keys: list[str], data: bytes, signature: str | None) -> bool:
    """True if ``signature`` is a valid signature of ``data`` by one of ``public_keys``."""
    if not signature:
        return False
    try:
        sig = base64.b64decode(signature, validate=True)
    except ValueError:
        return False
    import nacl.exceptions

    for key in public_keys:
        verify_key = _verify_key(key)
        if verify_key is None:
            continue
        try:
            verify_key.verify(data, sig)
            return True
        except (nacl.exceptions.BadSignatureError, ValueError):
            continue
    return False


@functools.lru_cache(maxsize=64)
def _verify_key(key: str) -> nacl.signing.VerifyKey | None:
    """The verify key of an nkey public key, made once per key (as ``Signer`` makes the key
    pair once per seed): decoding the key (base32, its CRC) and building the ``VerifyKey``
    for each command was as much work again as checking its signature. Keyed by the key's
    text, so a changed key (``controller.pub`` rotated) is a new entry; the keys an agent is
    given are a handful, the cache's bound only keeps a process that is handed many small."""
    import nacl.signing

    raw = _raw_public_key(key)
    return None if raw is None else nacl.signing.VerifyKey(raw)


def _raw_public_key(key: str) -> bytes | None:
    """The 32 key bytes of an nkey public key (``U...``), or None if it is not one."""
    try:
        text = key.strip().encode()
        decoded = base64.b32decode(text + b"=" * (-len(text) % 8))
    except ValueError:
        return None
    if len(decoded) != 35 or decoded[0] != nkeys.PREFIX_BYTE_USER:
        return None
    body, crc = decoded[:-2], decoded[-2:]
    if nkeys.crc16_checksum(body) != crc:
        return None
    return body[1:]


def load_public_keys(value: str) -> list[str]:
    """Controller public keys from a key (``U...``) or a file of them (one per line)."""
    value = value.strip()
    if value.startswith("U") and _raw_public_key(value) is not None:
        return [value]
    path = Path(value)
    try:
        lines = path.read_text().split()
    except OSError as e:
        raise AuthError(
            f"controller key {value!r}: not a public key (U...) nor a readable file "
            f"({e.strerror or e})"
        ) from None
    keys = [k for k in lines if _raw_public_key(k) is not None]
    if not keys:
        raise AuthError(f"{path} holds no nkey public key (U...)")
    return keys


# --- the directory -------------------------------------------------------------------------------


def init(directory: Path, prefix: str = DEFAULT_PREFIX, *, force: bool = False) -> list[Identity]:
    """Create DIR with one identity per role and the server configuration."""
    directory = Path(directory)
    server_config(prefix, [])  # an invalid prefix is refused before anything is written
    if (directory / IDENTITIES_FILE).exists() and not force:
        raise AuthError(
            f"{directory} already holds identities; use `marduk auth add-agent`, `rotate` or "
            "`revoke` (or --force to start over, which invalidates every key)"
        )
    _private_dir(directory)
    identities = [_create(directory, role, role) for role in ROLES]
    _save(directory, prefix, identities)
    return identities


def add_agent(directory: Path, job: str) -> Identity:
    """An agent credential valid for one job's subjects only (``agent-<job>.nk``)."""
    check_job(job)
    prefix, identities = _load(directory)
    name = f"agent-{job}"
    if any(i.name == name for i in identities):
        raise AuthError(f"{name} exists already in {directory}; rotate or revoke it")
    identity = _create(Path(directory), name, "agent", job)
    _save(Path(directory), prefix, [*identities, identity])
    return identity


def rotate(directory: Path, name: str) -> Identity:
    """A new key for identity ``name`` in ``<name>.nk``; the old key stays valid beside it
    (``previous``) until ``finish_rotation`` or the next rotate, so a running holder, which
    keeps the seed it connected with, goes on working and takes the new seed at its restart."""
    prefix, identities = _load(directory)
    old = _find(identities, name, directory)
    new = _create(Path(directory), name, old.role, old.job)
    new = Identity(new.name, new.role, new.public_key, new.job, previous=old.public_key)
    _save(Path(directory), prefix, [new if i.name == name else i for i in identities])
    return new


def finish_rotation(directory: Path, name: str) -> Identity:
    """End ``name``'s rotation: its previous key is refused from the next reload on, and a
    connection still holding it is closed."""
    prefix, identities = _load(directory)
    old = _find(identities, name, directory)
    if old.previous is None:
        raise AuthError(f"{name} has no rotation to finish (no previous key)")
    done = Identity(old.name, old.role, old.public_key, old.job)
    _save(Path(directory), prefix, [done if i.name == name else i for i in identities])
    return old


def revoke(directory: Path, name: str) -> Identity:
    """Remove identity ``name`` (and its seed file) from DIR and the server configuration."""
    prefix, identities = _load(directory)
    old = _find(identities, name, directory)
    (Path(directory) / f"{name}.nk").unlink(missing_ok=True)
    _save(Path(directory), prefix, [i for i in identities if i.name != name])
    return old


def update_config(directory: Path) -> None:
    """Write DIR's server configuration again from its identities (same keys): after an
    upgrade that changed the permissions."""
    prefix, identities = _load(directory)
    _save(Path(directory), prefix, identities)


def identities(directory: Path) -> tuple[str, list[Identity]]:
    return _load(directory)


def _find(identities: list[Identity], name: str, directory: Path) -> Identity:
    for identity in identities:
        if identity.name == name:
            return identity
    known = ", ".join(i.name for i in identities) or "none"
    raise AuthError(f"no identity {name!r} in {directory} (known: {known})")


def _create(directory: Path, name: str, role: str, job: str | None = None) -> Identity:
    seed = new_user_seed()
    path = directory / f"{name}.nk"
    # Created 0600 before anything is written: the seed is never readable by others.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(seed + b"\n")
    os.chmod(path, 0o600)
    return Identity(name=name, role=role, public_key=public_key_of(seed), job=job)


def _private_dir(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)


def _save(directory: Path, prefix: str, identities: list[Identity]) -> None:
    doc = {"prefix": prefix, "identities": [asdict(i) for i in identities]}
    _write(directory / IDENTITIES_FILE, json.dumps(doc, indent=2) + "\n", 0o600)
    _write(directory / CONFIG_FILE, server_config(prefix, identities), 0o600)
    # During a rotation agents must accept commands signed with either controller key.
    controllers = [k for i in identities if i.role == "controller" for k in _keys(i)]
    _write(directory / CONTROLLER_PUB, "".join(k + "\n" for k in controllers), 0o644)


def _keys(identity: Identity) -> list[str]:
    """The public keys the server accepts for ``identity``: its key, and during a rotation
    the previous one."""
    return [identity.public_key] + ([identity.previous] if identity.previous else [])


def _write(path: Path, text: str, mode: int) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _load(directory: Path) -> tuple[str, list[Identity]]:
    path = Path(directory) / IDENTITIES_FILE
    try:
        doc = json.loads(path.read_text())
        return doc["prefix"], [Identity(**i) for i in doc["identities"]]
    except FileNotFoundError:
        raise AuthError(
            f"{directory} is not an auth directory: run `marduk auth init {directory}`"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise AuthError(f"cannot read {path}: {e}") from None


# --- the server configuration --------------------------------------------------------------------


def permissions(
    role: str, prefix: str, job: str | None = None, name: str | None = None
) -> dict[str, list[str]]:
    """Subjects an identity of ``role`` may publish to and subscribe to.

    Replies: each identity reads only its own inbox prefix, ``_INBOX.<name>.>`` (the clients
    connect with that prefix), so no credential reads another's replies.
    """
    p = prefix
    inbox = f"_INBOX.{name or role}.>"
    if role == "controller":
        return {
            "publish": [f"{p}.>", "$JS.API.>", "$JS.ACK.>", "$JS.FC.>", "$KV.>", "_INBOX.>"],
            "subscribe": [f"{p}.>", "$JS.>", "$KV.>", "$SRV.>", "_INBOX.>"],
        }
    if role == "agent":
        j = job or "*"
        return {
            "publish": [
                f"{p}.{j}.{leaf}"
                for leaf in (
                    "register",
                    "deregister",
                    "ack",
                    "report",
                    "request",
                    "params.applied",
                    "perf",
                )
            ],
            "subscribe": [f"{p}.{j}.cmd.>", f"{p}.ctl.hello", inbox],
        }
    if role == "monitor":
        # health.stored: what the stream stored (it sends no acknowledgement: health_stream.py).
        return {"publish": [f"{p}.health"], "subscribe": [f"{p}.health.stored", inbox]}
    if role == "admin":
        return {
            # Not $SRV.>: the micro library answers on whatever reply subject it is given,
            # with the controller's rights. Discover it with the controller or system account.
            # ctl.params.set: only admins change a job's live parameters (decisions.md #20).
            "publish": [
                f"{p}.health",
                f"{p}.ctl.query",
                f"{p}.ctl.forget",
                f"{p}.ctl.drain",
                f"{p}.ctl.perf_query",
                f"{p}.ctl.params.set",
                f"{p}.ctl.params.get",
            ],
            "subscribe": [f"{p}.*.events", f"{p}.ctl.hello", f"{p}.health.stored", inbox],
        }
    raise AuthError(f"unknown role {role!r} (roles: {', '.join(ROLES)})")


def server_config(prefix: str, identities: list[Identity]) -> str:
    """A nats-server ``authorization`` block: one nkey user per identity, with its permissions."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*", prefix):
        raise AuthError(f"invalid prefix {prefix!r}")
    lines = [
        "# Generated by `marduk auth`; do not edit (regenerated by add-agent, rotate, revoke).",
        "# Standalone: nats-server -c nats-server.conf -js. In an existing server's config:",
        "#   include ./nats-server.conf   (then reload: nats-server --signal reload)",
        "authorization {",
        "  users = [",
    ]
    for i in identities:
        perms = permissions(i.role, prefix, i.job, i.name)
        scope = f" job {i.job}" if i.job else ""
        for key in _keys(i):
            note = "" if key == i.public_key else " (previous key, until rotate --finish)"
            lines += [
                f"    # {i.name}: {i.role}{scope}{note}",
                f"    {{ nkey: {key}, permissions: {{",
                f"        publish: {{ allow: {json.dumps(perms['publish'])} }},",
                f"        subscribe: {{ allow: {json.dumps(perms['subscribe'])} }} }} }},",
            ]
    lines += ["  ]", "}", ""]
    return "\n".join(lines)
