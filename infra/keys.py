"""The key file of a rollstream home, ``<home>/keys.json``: made once by ``rollstream up``,
read by every service's settings (schemas/settings.py) and by ``rollstream keys``::

    key_path(home) -> Path                      where it is (made or not)
    create_keys(home) -> (path, created)        make it unless it exists; an existing one is
                                                read (KeyFileError when it cannot be used) and
                                                never written
    read_keys(home) -> KeyRing                  its keys; KeyFileError when there is none

Made atomically, readable by its owner only: the keys go to a temporary file created with mode
0600 beside it (O_EXCL), which is fsynced and then hard-linked to ``keys.json`` -- a link never
replaces a file, so two ``rollstream up`` at once keep the first one's keys and a crash leaves
either no file or a whole one. Where the file system has no hard links it is renamed instead,
after a check that no file is there. What the file holds and who holds which key:
schemas/keys.py.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from rollstream.schemas.keys import KEY_FILE, KeyFileError, KeyRing, new_keys, render
from rollstream.schemas.settings import read_home_keys

__all__ = ["KeyFileError", "create_keys", "key_path", "read_keys"]

_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK}


def key_path(home: Path) -> Path:
    return Path(home) / KEY_FILE


def _token() -> str:
    return secrets.token_urlsafe(32)


def create_keys(home: Path, token: Callable[[], str] = _token) -> tuple[Path, bool]:
    """Make ``<home>/keys.json`` with a fresh key per role unless it exists; ``(path, created)``.
    An existing file is read first, so a broken or open one is said now (KeyFileError)."""
    path = key_path(home)
    if read_home_keys(Path(home)) is not None:
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.write(fd, render(new_keys(token)).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        created = _publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if created:
        _fsync_dir(path.parent)
    else:  # another `up` made it first: its keys stand (read, so a broken one is said)
        read_keys(home)
    return path, created


def _publish(tmp: Path, path: Path) -> bool:
    """Give ``tmp`` the name ``path`` unless that exists; whether it did."""
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
    if path.exists():  # no hard links here: a rename, which would replace a file
        return False
    os.rename(tmp, path)
    return True


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory
    finally:
        os.close(fd)


def read_keys(home: Path) -> KeyRing:
    """The keys of ``<home>/keys.json``; KeyFileError when it is missing or cannot be used."""
    ring = read_home_keys(Path(home))
    if ring is None:
        raise KeyFileError(
            f"no key file at {key_path(home)}: `rollstream up` makes it (or `rollstream keys "
            "create` without starting a broker)"
        )
    return ring
