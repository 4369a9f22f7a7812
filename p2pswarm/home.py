"""A node's state directory: its keyring (swarm secrets) and its identity key.

Layout (directory mode 0700, files 0600, each written atomically)::

    HOME/keyring.json    {"format": "p2pswarm-keyring", "version": 1,
                          "primary_key_id": "<hex>", "secrets": ["<join token>", ...]}
    HOME/identity.json   {"format": "p2pswarm-identity", "version": 1,
                          "ed25519_private_key": "<hex>"}

Secrets are stored as join tokens so a damaged file is caught by their checksum. The
CLI decides where HOME is (--home, P2PSWARM_HOME, ~/.p2pswarm); this module only gets
the path.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pswarm.errors import ConfigError
from p2pswarm.security import Identity, Keyring, SwarmSecret

__all__ = ["Home", "scratch_dir", "write_private"]

_scratch_root: Path | None = None


def scratch_dir(prefix: str) -> Path:
    """A fresh directory for an agent without a state directory (a bare simulation), under
    one temporary root per process that is removed when the process exits."""
    global _scratch_root
    if _scratch_root is None:
        _scratch_root = Path(tempfile.mkdtemp(prefix="p2pswarm-scratch-"))
        atexit.register(shutil.rmtree, _scratch_root, True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=_scratch_root))

_KEYRING_FORMAT = "p2pswarm-keyring"
_IDENTITY_FORMAT = "p2pswarm-identity"
_FILE_VERSION = 1


@dataclass(frozen=True, slots=True)
class Home:
    path: Path

    @property
    def keyring_path(self) -> Path:
        return self.path / "keyring.json"

    @property
    def identity_path(self) -> Path:
        return self.path / "identity.json"

    def has_swarm(self) -> bool:
        return self.keyring_path.exists()

    # ----------------------------------------------------------------- writing

    def init(self, secret: SwarmSecret | None = None, *, force: bool = False) -> SwarmSecret:
        """Start a new swarm here (a fresh secret unless one is given); returns its secret.

        An existing identity is kept, so this fellow's node id does not change.
        """
        if self.has_swarm() and not force:
            raise ConfigError(
                f"{self.path} already holds a swarm; use --force to replace it "
                f"(fellows that joined it with its token will no longer be let in)"
            )
        secret = secret if secret is not None else SwarmSecret.generate()
        self._make_dir()
        self.load_identity()
        self.save_keyring(Keyring([secret]))
        return secret

    def join_swarm(self, secret: SwarmSecret, *, force: bool = False) -> Keyring:
        """Write a keyring holding the join token's secret (and an identity if missing).

        Joining the swarm this home already belongs to changes nothing; another swarm
        needs ``force``.
        """
        if self.has_swarm():
            keyring = self.load_keyring()
            if secret in keyring.secrets:
                self.load_identity()
                return keyring
            if not force:
                raise ConfigError(
                    f"{self.path} already holds another swarm; to leave it and join this "
                    f"one, run join again with --force"
                )
        self._make_dir()
        self.load_identity()
        keyring = Keyring([secret])
        self.save_keyring(keyring)
        return keyring

    def written_keyring(self) -> bytes | None:
        """The keyring file's bytes as they are now (None: no keyring): what a run that
        wrote it hands to ``forget_swarm``."""
        try:
            return self.keyring_path.read_bytes()
        except FileNotFoundError:
            return None

    def forget_swarm(self, written: bytes) -> bool:
        """Remove the swarm's keys (the identity stays), only when the keyring file still
        holds exactly ``written``, the bytes this run wrote: a join whose token the seeds
        refused leaves the home as it found it, and never deletes a keyring that was there
        before, or that another run wrote since. Returns whether it removed the file."""
        if self.written_keyring() != written:
            return False
        try:
            self.keyring_path.unlink()
        except FileNotFoundError:
            return False
        return True

    def save_keyring(self, keyring: Keyring) -> None:
        self._require_dir()
        document = {
            "format": _KEYRING_FORMAT,
            "version": _FILE_VERSION,
            "primary_key_id": keyring.primary_key_id.hex(),
            "secrets": [secret.token() for secret in keyring.secrets],
        }
        write_private(self.keyring_path, document)

    # ----------------------------------------------------------------- reading

    def load_keyring(self) -> Keyring:
        document = self._read(self.keyring_path, _KEYRING_FORMAT)
        try:
            secrets = [SwarmSecret.from_token(token) for token in document["secrets"]]
            primary = bytes.fromhex(document["primary_key_id"])
            return Keyring(secrets, primary_key_id=primary)
        except (KeyError, TypeError, ValueError, AttributeError, ConfigError) as exc:
            raise ConfigError(f"{self.keyring_path} is not a usable keyring: {exc}") from None

    def load_identity(self) -> Identity:
        """This fellow's identity; made and saved on first use."""
        self._require_dir()
        if not self.identity_path.exists():
            identity = Identity.generate()
            write_private(
                self.identity_path,
                {
                    "format": _IDENTITY_FORMAT,
                    "version": _FILE_VERSION,
                    "ed25519_private_key": identity.private_bytes().hex(),
                },
            )
            return identity
        document = self._read(self.identity_path, _IDENTITY_FORMAT)
        try:
            return Identity.from_private_bytes(bytes.fromhex(document["ed25519_private_key"]))
        except (KeyError, TypeError, ValueError, AttributeError, ConfigError) as exc:
            raise ConfigError(f"{self.identity_path} is not a usable identity: {exc}") from None

    # ----------------------------------------------------------------- helpers

    def _no_swarm(self) -> ConfigError:
        return ConfigError(
            f"no swarm in {self.path}: run `p2pswarm init` or `p2pswarm join --token ...`"
        )

    def _require_dir(self) -> None:
        if not self.path.is_dir():
            raise self._no_swarm()

    def _make_dir(self) -> None:
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.path, 0o700)  # mkdir's mode is cut by the umask; be exact
        except OSError as exc:
            raise ConfigError(f"cannot create {self.path}: {exc.strerror}") from exc

    def _read(self, path: Path, expected_format: str) -> dict[str, Any]:
        if not path.exists():
            raise self._no_swarm()
        _check_private(path)
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror}") from exc
        except ValueError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(document, dict) or document.get("format") != expected_format:
            raise ConfigError(f"{path} is not a {expected_format} file")
        if document.get("version") != _FILE_VERSION:
            raise ConfigError(
                f"{path} has format version {document.get('version')!r}; this p2pswarm "
                f"reads version {_FILE_VERSION}"
            )
        return document


def _check_private(path: Path) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        what = "readable" if mode & 0o044 else "writable"
        raise ConfigError(
            f"{path} is {what} by other users (mode {mode:04o}); run: chmod 600 {path}"
        )


def write_private(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` as JSON to ``path``, mode 0600, all or nothing (ConfigError)."""
    data = (json.dumps(document, indent=2) + "\n").encode("utf-8")
    try:
        # mkstemp creates the file 0600 before anything secret is in it.
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise ConfigError(f"cannot write in {path.parent}: {exc.strerror}") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, 0o600)
        os.replace(tmp_name, path)
    except OSError as exc:
        try:
            os.unlink(tmp_name)
        except OSError:
            pass
        raise ConfigError(f"cannot write {path}: {exc.strerror}") from exc
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)
