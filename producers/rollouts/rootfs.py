"""A small root filesystem for sandboxes, built from this machine: no registry, no download.

Contents: busybox (static: sh and the usual tools as applet links), the host's Python 3 (the
binary, its standard library without tests/IDLE/tkinter/static libraries, the shared libraries
it and its extension modules link, found with ldd), prlimit (so bwrap can run on it too), a
passwd/group with ``sandbox`` (uid/gid 1000, home /work), and the mount points /work /tmp
/proc /dev /sys.
Merged /usr layout (/bin -> usr/bin, /lib -> usr/lib, /lib64 -> usr/lib64). About 40 MB.

``ensure_rootfs_tar(cache_dir)`` writes it once as a deterministic tar named by a key over its
inputs (builder version, and path, size, mtime of every host file taken), so a rerun finds it
in the cache in milliseconds and a changed host Python makes a new one. The docker provider
imports that tar as its default image (``docker import``: docker_sandbox.ensure_image);
``extract_rootfs`` unpacks it as a directory a bwrap spec can name as its ``image``.

Errors: SandboxUnavailable (sandbox.py) when a needed host file is missing (no python3, no
busybox: Debian's python3 and busybox-static packages) or the cache cannot be written.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import stat
import subprocess
import tarfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from rollstream.producers.rollouts.sandbox import SandboxUnavailable

__all__ = [
    "ROOTFS_VERSION",
    "RootfsPlan",
    "ensure_rootfs_tar",
    "extract_rootfs",
    "plan_rootfs",
    "write_rootfs_tar",
]

ROOTFS_VERSION = 1  # bump when the layout below changes: the cache key changes with it

_STDLIB_SKIP = {
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "pydoc_data",
    "site-packages",
    "dist-packages",
    "__phello__",
}
# tests, and modules that pull big libraries a coding task does not need (Berkeley DB, Kerberos
# through NIS, curses, readline, OSS audio)
_DYNLOAD_SKIP = re.compile(
    r"^(_test|_ctypes_test|_xxtestfuzz|xxlimited|_xxsubinterpreters|_dbm|nis|_curses|readline"
    r"|ossaudiodev)"
)
_LDD_LINE = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x")
_PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\n"
    "sandbox:x:1000:1000:sandbox:/work:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
)
_GROUP = "root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n"
_SYMLINKS = {"bin": "usr/bin", "sbin": "usr/sbin", "lib": "usr/lib", "lib64": "usr/lib64"}
_DIRS = {  # path: (mode, uid)
    "usr": (0o755, 0),
    "usr/bin": (0o755, 0),
    "usr/sbin": (0o755, 0),
    "usr/lib": (0o755, 0),
    "usr/lib64": (0o755, 0),
    "etc": (0o755, 0),
    "dev": (0o755, 0),
    "proc": (0o755, 0),
    "sys": (0o755, 0),
    "root": (0o700, 0),
    "tmp": (0o1777, 0),
    "work": (0o755, 1000),
}


@dataclass(frozen=True, slots=True)
class RootfsPlan:
    """What goes in: ``files`` maps a rootfs path (no leading /) to the host file to copy;
    ``links`` a rootfs path to a symlink target; ``texts`` a rootfs path to small file content."""

    files: Mapping[str, Path]
    links: Mapping[str, str]
    texts: Mapping[str, bytes]

    def key(self) -> str:
        h = hashlib.sha256(f"rollstream-rootfs-v{ROOTFS_VERSION}\n".encode())
        for dest, src in sorted(self.files.items()):
            st = src.stat()
            h.update(f"f {dest} {src} {st.st_size} {st.st_mtime_ns} {st.st_mode:o}\n".encode())
        for dest, target in sorted(self.links.items()):
            h.update(f"l {dest} {target}\n".encode())
        for dest, text in sorted(self.texts.items()):
            h.update(f"t {dest} ".encode() + hashlib.sha256(text).digest() + b"\n")
        return h.hexdigest()[:16]


def _usr(path: str) -> str:
    """A host path as it sits in the merged-/usr rootfs, without the leading slash."""
    path = os.path.normpath(path).lstrip("/")
    for top in ("bin", "sbin", "lib", "lib64"):
        if path == top or path.startswith(top + "/"):
            return "usr/" + path
    return path


def _ldd(paths: Iterable[Path]) -> set[str]:
    """Every shared library (host path) that ``paths`` link, by ldd."""
    libs: set[str] = set()
    for path in paths:
        out = subprocess.run(
            ["ldd", str(path)], capture_output=True, text=True, check=False, timeout=30
        ).stdout
        libs.update(m.group(1) for m in map(_LDD_LINE.search, out.splitlines()) if m)
    return libs


def _tool(name: str, where: Iterable[str] = ("/usr/bin", "/bin", "/usr/sbin")) -> Path:
    for d in where:
        p = Path(d) / name
        if p.is_file():
            return p
    raise SandboxUnavailable(f"rootfs: {name} not found on this machine (apt-get install it)")


def plan_rootfs(
    *,
    python: Path | None = None,
    busybox: Path | None = None,
    extra: Mapping[str, Path] | None = None,
) -> RootfsPlan:
    """The rootfs of this machine: ``python`` (default /usr/bin/python3), ``busybox`` (static;
    default /usr/bin/busybox), ``extra`` rootfs path -> host file or directory (e.g. a pure-
    Python package dir into usr/lib/python3.11/site-packages)."""
    python = (python or _tool("python3")).resolve()
    busybox = busybox or _tool("busybox")
    prlimit = _tool("prlimit")
    files: dict[str, Path] = {}
    links: dict[str, str] = dict(_SYMLINKS)
    texts: dict[str, bytes] = {
        "etc/passwd": _PASSWD.encode(),
        "etc/group": _GROUP.encode(),
        "etc/hosts": b"127.0.0.1 localhost\n",
        "etc/hostname": b"sandbox\n",
        "etc/resolv.conf": b"",
    }
    version = subprocess.run(
        [str(python), "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.split()
    name = f"python{version[0]}.{version[1]}"
    stdlib = Path(f"/usr/lib/{name}")
    if not stdlib.is_dir():
        raise SandboxUnavailable(f"rootfs: {python}'s standard library is not at {stdlib}")
    files[f"usr/bin/{name}"] = python
    links["usr/bin/python3"] = name
    links["usr/bin/python"] = name
    files["usr/bin/busybox"] = busybox
    files["usr/bin/prlimit"] = prlimit
    dynload: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        rel = os.path.relpath(dirpath, stdlib)
        if rel == ".":
            dirnames[:] = [
                d for d in dirnames if d not in _STDLIB_SKIP and not d.startswith("config-")
            ]
        dirnames.sort()
        for fn in sorted(filenames):
            src = Path(dirpath) / fn
            if rel == "lib-dynload" and _DYNLOAD_SKIP.match(fn):
                continue
            if fn.endswith((".opt-1.pyc", ".opt-2.pyc")) or src.is_symlink():
                continue
            files[_usr(str(src))] = src
            if fn.endswith(".so"):
                dynload.append(src)
    for lib in sorted(_ldd([python, prlimit, *dynload])):
        files[_usr(lib)] = Path(lib).resolve()
    applets = subprocess.run(
        [str(busybox), "--list"], capture_output=True, text=True, check=True, timeout=30
    ).stdout.split()
    for applet in applets:
        dest = f"usr/bin/{applet}"
        if applet != "busybox" and dest not in files and dest not in links:
            links[dest] = "busybox"
    for dest, src in (extra or {}).items():
        dest = dest.strip("/")
        if src.is_dir():
            for dirpath, dirnames, filenames in os.walk(src):
                dirnames.sort()
                for fn in sorted(filenames):
                    p = Path(dirpath) / fn
                    if not p.is_symlink():
                        files[f"{dest}/{p.relative_to(src)}"] = p
        else:
            files[dest] = src
    return RootfsPlan(files, links, texts)


def write_rootfs_tar(plan: RootfsPlan, dest: Path) -> Path:
    """Write ``plan`` as a tar with fixed times and owners (same inputs, same bytes)."""
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    dirs = dict(_DIRS)
    for path in [*plan.files, *plan.links, *plan.texts]:
        parent = os.path.dirname(path)
        while parent and parent not in dirs and parent not in _SYMLINKS:
            dirs[parent] = (0o755, 0)
            parent = os.path.dirname(parent)
    with tarfile.open(tmp, "w", format=tarfile.GNU_FORMAT) as tar:
        for path in sorted(dirs):
            mode, uid = dirs[path]
            info = tarfile.TarInfo(path)
            info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, mode, uid, uid
            tar.addfile(info)
        for path, target in sorted(plan.links.items()):
            info = tarfile.TarInfo(path)
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
            tar.addfile(info)
        for path, text in sorted(plan.texts.items()):
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(text), 0o644
            tar.addfile(info, io.BytesIO(text))
        for path, src in sorted(plan.files.items()):
            st = src.stat()
            info = tarfile.TarInfo(path)
            info.size = st.st_size
            info.mode = 0o755 if st.st_mode & stat.S_IXUSR else 0o644
            with src.open("rb") as f:
                tar.addfile(info, f)
    os.replace(tmp, dest)
    return dest


def ensure_rootfs_tar(cache_dir: Path, plan: RootfsPlan | None = None) -> tuple[Path, str]:
    """The rootfs tar in ``cache_dir`` (built if missing): (path, key)."""
    plan = plan or plan_rootfs()
    key = plan.key()
    path = cache_dir / f"rootfs-{key}.tar"
    if not path.is_file():
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            write_rootfs_tar(plan, path)
        except OSError as exc:
            raise SandboxUnavailable(f"rootfs: cannot write {path}: {exc}") from exc
    return path, key


def extract_rootfs(tar_path: Path, dest: Path) -> Path:
    """Unpack a rootfs tar as a directory (for a bwrap spec's ``image``); owners as in the tar
    when run as root."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest, filter="tar")
    os.chmod(dest, 0o755)
    return dest
