"""The bootstrap secret: who may attach to an engine (stdlib only, no torch).

Anyone who can reach the bootstrap port would otherwise learn the ring's address (the shm
name, or an RDMA address + rkey) and the tokenizer path, and could write into the ring. So the
handshake is a mutual challenge–response over a shared secret (see
:mod:`blink.transport.bootstrap`): each side proves it knows the secret with an HMAC-SHA256
over both sides' fresh nonces; the secret itself never crosses the wire.

Where the secret comes from:

- ``blink serve`` generates one per start and hands it to its two children in the
  environment variable :data:`SECRET_ENV` (not on the command line, which ``ps`` shows; a
  process's environment is readable only by its own user). The children remove it from their
  environment as they read it, so nothing they start inherits it.
- ``--bootstrap-secret-file FILE`` (``blink engine``, ``blink serve [--frontend-only]``): the
  secret is the file's content (surrounding whitespace stripped); the file must not be
  readable by group or others. ``blink engine`` creates the file (mode 0600) if it does not
  exist; without the flag it writes a fresh secret to :func:`default_secret_path` and prints
  where.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from pathlib import Path

from blink import env as blink_env
from blink.transport.base import TransportError

#: environment variable ``blink serve`` passes the secret to its children in
SECRET_ENV = "BLINK_BOOTSTRAP_SECRET"
#: bytes of randomness in a generated secret (written as hex)
SECRET_BYTES = 32
#: shortest secret accepted from a file (bytes)
MIN_SECRET_BYTES = 16
NONCE_BYTES = 32

_ENGINE_TAG = b"blink-bootstrap-engine\0"
_FRONTEND_TAG = b"blink-bootstrap-frontend\0"


class SecretError(TransportError):
    """The bootstrap secret cannot be read, written, or is unfit (too short, file too open)."""


def generate_secret() -> bytes:
    """A fresh random secret (hex text, so it can live in a file or an environment variable)."""
    return secrets.token_hex(SECRET_BYTES).encode()


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def _mac(secret: bytes, tag: bytes, first: str, second: str) -> str:
    return hmac.new(secret, tag + first.encode() + b"\0" + second.encode(), hashlib.sha256).hexdigest()


def engine_proof(secret: bytes, frontend_nonce: str, engine_nonce: str) -> str:
    """What the engine sends to prove it knows the secret (the frontend checks it)."""
    return _mac(secret, _ENGINE_TAG, frontend_nonce, engine_nonce)


def frontend_proof(secret: bytes, engine_nonce: str, frontend_nonce: str) -> str:
    """What the frontend sends to prove it knows the secret (the engine checks it).

    A different tag and order than :func:`engine_proof`, so neither side can replay the
    other's proof back to it."""
    return _mac(secret, _FRONTEND_TAG, engine_nonce, frontend_nonce)


def proofs_equal(expected: str, got: object) -> bool:
    """Constant-time comparison of a received proof (any JSON value) with the expected one."""
    if not isinstance(got, str):
        return False
    return hmac.compare_digest(expected.encode(), got.encode("utf-8", "replace"))


def check_secret(secret: bytes, where: str) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"{where}: the bootstrap secret must be at least {MIN_SECRET_BYTES} "
                          f"bytes, got {len(secret)}")
    return secret


def load_secret_file(path: str | os.PathLike[str]) -> bytes:
    """The secret stored in ``path``; :class:`SecretError` if missing, empty, too short or
    readable by group/others (as ssh refuses an open private key)."""
    p = Path(path)
    try:
        st = p.stat()
        data = p.read_bytes()
    except FileNotFoundError:
        raise SecretError(f"bootstrap secret file {p} does not exist") from None
    except OSError as exc:
        raise SecretError(f"cannot read the bootstrap secret file {p}: {exc.strerror or exc}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(f"bootstrap secret file {p} is accessible by group or others "
                          f"(mode {stat.S_IMODE(st.st_mode):o}); run: chmod 600 {p}")
    return check_secret(data.strip(), f"bootstrap secret file {p}")


def write_secret_file(path: str | os.PathLike[str], secret: bytes) -> Path:
    """Write ``secret`` to ``path`` with mode 0600, atomically (temp file + rename), creating
    the parent directory (0700) if needed."""
    p = Path(path).expanduser()
    try:
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".blink-secret-", dir=p.parent)  # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secret + b"\n")
            os.replace(tmp, p)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except OSError as exc:
        raise SecretError(f"cannot write the bootstrap secret file {p}: {exc.strerror or exc}") from None
    return p


def load_or_create_secret_file(path: str | os.PathLike[str]) -> tuple[bytes, bool]:
    """(secret, created): the secret in ``path``, or a new one written there if it does not
    exist yet."""
    p = Path(path).expanduser()
    if p.exists():
        return load_secret_file(p), False
    secret = generate_secret()
    write_secret_file(p, secret)
    return secret, True


def default_secret_path(port: int) -> Path:
    """Where a standalone ``blink engine`` without ``--bootstrap-secret-file`` writes its
    secret: ``$XDG_RUNTIME_DIR/blink/`` (a per-user 0700 tmpfs) if set, else ``~/.blink/``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "blink" if runtime and os.path.isdir(runtime) else Path.home() / ".blink"
    return base / f"bootstrap-{port}.secret"


def secret_from_env(remove: bool = True) -> bytes | None:
    """The secret a supervisor passed in :data:`SECRET_ENV`, removed from this process's
    environment (so children do not inherit it) unless ``remove`` is False."""
    value = blink_env.pop(SECRET_ENV) if remove else blink_env.get(SECRET_ENV)
    if not value:
        return None
    return check_secret(value.strip().encode(), f"${SECRET_ENV}")
