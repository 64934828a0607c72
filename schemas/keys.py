"""The keys of a rollstream home, ``<home>/keys.json``: one random key per role, made once by
``rollstream up`` (infra/keys.py writes the file, schemas/settings.py reads it), and which
settings each key fills when they are left unset. Pure: no file is touched here.

    ROLES                                  admin, evaluator, analyst, model, metrics
    new_keys(token) -> KeyRing             one key per role, ``rs_<role>_<token()>``
    render(ring) -> str                    the file's text
    parse(raw, where) -> KeyRing           the file's bytes read back (KeyFileError: why not)
    check_private(mode, where)             KeyFileError unless a regular file of its owner only
    fills(ring, present) -> {field: value} the key settings among ``present`` (field -> value
                                           now) that are unset, filled from ``ring`` (FILLS:
                                           which role's key goes where; TOGETHER: settings
                                           filled only when all of them are unset)

Who holds which key (docs/security.md): the admin key opens the proxy's rollout creation, jobs,
pool and weight routes (operators, the rollout service) and the model server's weight and
control routes (the proxy sends it there); the evaluator key posts a job's final rewards and
finishes its rollouts (the EVAL stage); the analyst key reads one namespace's analytics; the
model key is what the proxy sends to the model server for generation; the metrics key opens
every service's ``/metrics``. A harness never holds any of them: it gets a rollout token from the
proxy. A key names its role (``rs_admin_...``), so a leaked one is recognised.

Errors::

    SchemaError (schemas/errors.py)
    └── KeyFileError    the key file cannot be read, is open to group or others, or is no key
                        file; the message names the file (and ``chmod 600`` when that fixes it)
"""

from __future__ import annotations

import json
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from pydantic import SecretStr

from .errors import SchemaError

__all__ = [
    "FILLS",
    "KEY_FIELDS",
    "KEY_FILE",
    "MAX_FILE_BYTES",
    "ROLES",
    "TOGETHER",
    "KeyFileError",
    "KeyRing",
    "check_private",
    "fills",
    "is_unset",
    "new_keys",
    "parse",
    "render",
]

KEY_FILE: Final = "keys.json"  # under the home
FORMAT: Final = 1
ROLES: Final[tuple[str, ...]] = ("admin", "evaluator", "analyst", "model", "metrics")
MAX_FILE_BYTES: Final = 64 * 1024  # a key file is a few hundred bytes
MAX_ENTRIES: Final = 32  # roles in a file (a newer rollstream may add some: kept, not used)
_TOKEN: Final = re.compile(r"[A-Za-z0-9_-]{32,128}")  # secrets.token_urlsafe(32): 43 chars

# (setting, roles): a settings class that has the setting, left unset, gets these roles' keys
# (a list setting all of them, one key the first). proxy_api_keys holds the evaluator key as
# well until the proxy tells it apart (a proxy_evaluator_keys setting): fills() then narrows it.
FILLS: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("proxy_api_keys", ("admin", "evaluator")),  # the proxy: who may open its admin routes
    ("proxy_evaluator_keys", ("evaluator",)),  # ... its evaluator keys, once it has them
    ("proxy_backend_api_key", ("model",)),  # what the proxy sends to the model server
    ("proxy_backend_admin_key", ("admin",)),  # ... to its weight and control routes
    ("model_api_key", ("model",)),  # the model server's key: generation, read-only routes
    ("model_admin_key", ("admin",)),  # ... its weight and control routes
    ("analytics_api_keys", ("analyst", "admin")),  # the analytics server's keys
    ("analytics_api_key", ("analyst",)),  # what `report` and `replay` send to it
    ("rollouts_admin_key", ("admin",)),  # stage workers, run-job: rollouts at the proxy
    ("rollouts_evaluator_key", ("evaluator",)),  # the EVAL stage: final rewards, finish
    ("control_proxy_admin_key", ("admin",)),  # the controller: the proxy's status
    ("metrics_key", ("metrics",)),  # every service's /metrics
)
KEY_FIELDS: Final[frozenset[str]] = frozenset(name for name, _ in FILLS)
# Settings that take their keys together: from the file only when every one of them that the
# class has is unset. A worker given its admin key by hand (the demo's, for a proxy of its own)
# must not send that proxy the file's evaluator key; a model server given its model key by hand
# must not open its weight routes to the file's admin key while its proxy, given a backend key
# by hand beside it, sends another (each falls back to its model key: the pair stays matched).
TOGETHER: Final[tuple[frozenset[str], ...]] = (
    frozenset({"rollouts_admin_key", "rollouts_evaluator_key"}),
    frozenset({"proxy_api_keys", "proxy_evaluator_keys"}),
    frozenset({"model_api_key", "model_admin_key"}),
    frozenset({"proxy_backend_api_key", "proxy_backend_admin_key"}),
)


class KeyFileError(SchemaError):
    """The key file cannot be used; the message names it and says what to do."""


@dataclass(frozen=True, slots=True)
class KeyRing:
    """One key per role (``ROLES``), as secrets (never shown by repr or logs)."""

    keys: Mapping[str, SecretStr]

    def get(self, role: str) -> SecretStr:
        if role not in ROLES:
            raise KeyError(f"no role {role!r} (roles: {', '.join(ROLES)})")
        return self.keys[role]


def new_keys(token: Callable[[], str]) -> KeyRing:
    """A fresh key for every role: ``rs_<role>_`` and ``token()`` (secrets.token_urlsafe(32))."""
    keys = {}
    for role in ROLES:
        text = token()
        if not _TOKEN.fullmatch(text):
            raise ValueError("token() must give 32 to 128 URL-safe characters")
        keys[role] = SecretStr(f"rs_{role}_{text}")
    return KeyRing(keys)


def render(ring: KeyRing) -> str:
    """The file's text: ``{"format": 1, "keys": {role: key}}``, one role a line."""
    keys = {role: ring.get(role).get_secret_value() for role in ROLES}
    return json.dumps({"format": FORMAT, "keys": keys}, indent=2) + "\n"


def check_private(mode: int, where: Path | str) -> None:
    """KeyFileError unless the file is a regular file only its owner may access (``mode``:
    its st_mode)."""
    if not stat.S_ISREG(mode):
        raise KeyFileError(f"{where} is no regular file")
    if mode & 0o077:
        raise KeyFileError(
            f"{where} is open to group or others (mode {mode & 0o777:04o}): its keys may have "
            f"leaked; make it the owner's only with `chmod 600 {where}` (and replace the keys "
            "if others could read them)"
        )


def parse(raw: bytes, where: Path | str) -> KeyRing:
    """The key ring in a key file's bytes; KeyFileError naming ``where`` and what is wrong."""
    if len(raw) > MAX_FILE_BYTES:
        raise KeyFileError(f"{where}: not a key file (over {MAX_FILE_BYTES} bytes)")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise KeyFileError(f"{where}: not a key file (no JSON: {exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise KeyFileError(f"{where}: not a key file of format {FORMAT} (field `format`)")
    keys = data.get("keys")
    if not isinstance(keys, dict) or len(keys) > MAX_ENTRIES:
        raise KeyFileError(f"{where}: field `keys` is no object of at most {MAX_ENTRIES} roles")
    ring = {}
    for role in ROLES:
        key = keys.get(role)
        if not isinstance(key, str):
            raise KeyFileError(f"{where}: no key for role `{role}` (field `keys.{role}`)")
        prefix = f"rs_{role}_"
        if not (key.startswith(prefix) and _TOKEN.fullmatch(key[len(prefix) :])):
            raise KeyFileError(
                f"{where}: field `keys.{role}` is no key of that role ({prefix} and 32 to 128 "
                "URL-safe characters)"
            )
        ring[role] = SecretStr(key)
    return KeyRing(ring)


def is_unset(value: Any) -> bool:
    """A key setting left unset: None, empty, or a secret or list of them that is all empty."""
    if value is None:
        return True
    if isinstance(value, SecretStr):
        return not value.get_secret_value()
    if isinstance(value, str):
        return not value
    if isinstance(value, list | tuple):
        return all(is_unset(v) for v in value)
    return False


def fills(ring: KeyRing, present: Mapping[str, Any]) -> dict[str, Any]:
    """The values of the key settings in ``present`` (a settings class's key fields and their
    values now) that are unset: a list of keys for a list setting, else one key. A value that
    is set is left alone, and so are the unset ones ``TOGETHER`` with it."""
    out: dict[str, Any] = {}
    for name, roles in FILLS:
        if name not in present or not is_unset(present[name]):
            continue
        group = next((g for g in TOGETHER if name in g), frozenset())
        if any(not is_unset(present[other]) for other in group if other in present):
            continue  # set by hand beside it: the file's key would not match
        if name == "proxy_api_keys" and "proxy_evaluator_keys" in present:
            roles = ("admin",)  # the proxy knows evaluator keys: this one is no admin key there
        keys = [ring.get(role) for role in roles]
        out[name] = keys if isinstance(present[name], list | tuple) else keys[0]
    return out
