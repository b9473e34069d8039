"""Tenants and their API keys for `kvsched serve`, read from a TOML file.

    [[tenant]]
    name = "gold"
    api_key = "sk-gold-123"     # or api_keys = ["sk-a", "sk-b"] (rotation)
    tier = 0                    # every field below is optional
    kv_floor_blocks = 64
    kv_cap_blocks = 4096
    max_concurrent = 64
    rate_tokens_per_s = 50000
    burst_tokens = 100000
    weight = 1.0
    max_step_tokens = 512
    prefix_namespace = "team"

The same file may hold one `[scheduler]` table: the server's scheduler knobs
(SCHEDULER_KNOBS: admission, preempt_lower_tiers, the ladder, max_num_seqs,
max_batched_tokens, long_prefill_chunk, ...), read when the server starts
(`load_scheduler_table`); a reload leaves them as they are and says so when the
table changed.

Each tenant table becomes a `kvsched.TenantConfig`; an unknown field, a missing name
or key, a value of the wrong type, a duplicate name or a key shared by two
tenants is a `TenantsError` naming the tenant and the field. Keys are held only
as SHA-256 digests and compared in constant time against every known key
(`hmac.compare_digest`), so neither the comparison's timing nor a log line
reveals one.

`TenantRegistry.reload()` rereads the file and applies the difference to the
scheduler live: `add_tenant`, `update_tenant`, `remove_tenant`. A tenant whose
requests are still running cannot be removed yet (`TenantInUse`): its keys stop
working at once and the removal is retried (`retry_removals`) until it succeeds.
A file that does not parse changes nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import kvsched

_T = TypeVar("_T")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    # tomli, on Python 3.10 only: absent where mypy runs on a newer Python.
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

# field -> (accepted types, a word for the error message); every field but `name`
# and the key is passed to kvsched.TenantConfig as a keyword.
_INT = ((int,), "an integer")
_NUM = ((int, float), "a number")
_STR = ((str,), "a string")
FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "tier": _INT,
    "kv_floor_blocks": _INT,
    "kv_cap_blocks": _INT,
    "max_concurrent": _INT,
    "rate_tokens_per_s": _NUM,
    "burst_tokens": _NUM,
    "weight": _NUM,
    "max_step_tokens": _INT,
    "prefix_namespace": _STR,
}
_FLOATS = {"rate_tokens_per_s", "burst_tokens", "weight"}


def config_fields(config: kvsched.TenantConfig) -> dict[str, Any]:
    """A TenantConfig's keyword arguments but its name: `TenantConfig(name,
    **config_fields(c))` remakes it."""
    names = [a for a in dir(config) if not a.startswith("_") and a != "name"]
    return {a: v for a in names if not callable(v := getattr(config, a))}


class TenantsError(ValueError):
    """The tenants file is not usable; the message names the tenant and field."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class TenantEntry:
    """One tenant of the file: its scheduler config and its keys' digests."""

    config: kvsched.TenantConfig
    key_digests: tuple[bytes, ...] = field(repr=False)

    @property
    def name(self) -> str:
        return self.config.name


def _check_type(where: str, name: str, value: Any, types: tuple[type, ...], word: str) -> None:
    # TOML booleans are Python bools, which are ints: never a number here.
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise TenantsError(f"{where}: {name} must be {word}, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise TenantsError(f"{where}: {name} must be finite, got {value!r}")


def _entry(i: int, table: Any) -> TenantEntry:
    where = f"tenant #{i + 1}"
    if not isinstance(table, Mapping):
        raise TenantsError(f"{where}: must be a table ([[tenant]]), got {type(table).__name__}")
    name = table.get("name")
    if name is None:
        raise TenantsError(f"{where}: name is missing")
    _check_type(where, "name", name, *_STR)
    if not name:
        raise TenantsError(f"{where}: name must not be empty")
    where = f"tenant {name!r}"
    # fleet_unreachable: the [fleet] table's (kvsched.serve.fleet_budget), read there.
    allowed = {"name", "api_key", "api_keys", "fleet_unreachable", *FIELDS}
    for key in table:
        if key not in allowed:
            known = ", ".join(sorted(allowed))
            raise TenantsError(f"{where}: unknown field {key!r} (known: {known})")
    keys: list[str] = []
    if "api_key" in table:
        _check_type(where, "api_key", table["api_key"], *_STR)
        keys.append(table["api_key"])
    if "api_keys" in table:
        ks = table["api_keys"]
        if not isinstance(ks, list) or not all(isinstance(k, str) for k in ks):
            raise TenantsError(f"{where}: api_keys must be a list of strings")
        keys.extend(ks)
    if not keys:
        raise TenantsError(f"{where}: api_key is missing")
    if any(not k for k in keys):
        raise TenantsError(f"{where}: api_key must not be empty")
    for k in keys:
        _check_key(where, k)
    kw: dict[str, Any] = {}
    for key, (types, word) in FIELDS.items():
        if key in table:
            _check_type(where, key, table[key], types, word)
            kw[key] = float(table[key]) if key in _FLOATS else table[key]
    errors = (kvsched.KvSchedError, ValueError, TypeError, OverflowError)
    try:
        config = kvsched.TenantConfig(name, **kw)
    except errors as e:
        for key, value in kw.items():  # name the field: the first one refused alone
            try:
                kvsched.TenantConfig(name, **{key: value})
            except errors as e1:
                why = "out of range" if isinstance(e1, OverflowError) else str(e1)
                raise TenantsError(f"{where}: {key} = {value!r}: {why}") from None
        raise TenantsError(f"{where}: {e}") from None
    return TenantEntry(config, tuple(_digest(k) for k in dict.fromkeys(keys)))


_BOOL = ((bool,), "true or false")
# [scheduler] knob -> (accepted types, a word): kvsched.SchedulerConfig keywords.
SCHEDULER_KNOBS: dict[str, tuple[tuple[type, ...], str]] = {
    "admission": _STR,
    "watermark_blocks": _INT,
    "preempt_lower_tiers": _BOOL,
    "ladder": ((str, list), '"default", "off" or a list of rung tables'),
    "ladder_retry_after_s": _NUM,
    "max_num_seqs": _INT,
    "max_batched_tokens": _INT,
    "long_prefill_chunk": _INT,
    "max_waiting": _INT,
    "overhead_reserve": _NUM,
    "prefix_caching": _BOOL,
    "prefix_cache_partition": _STR,
}


def parse_scheduler_table(data: Mapping[str, Any]) -> dict[str, Any]:
    """The `[scheduler]` table of a parsed document as SchedulerConfig keywords
    (empty without one), each checked by name and type, and all of them
    together by kvsched.SchedulerConfig itself."""
    table = data.get("scheduler", {})
    if not isinstance(table, dict):
        raise TenantsError("scheduler: must be a table ([scheduler])")
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key not in SCHEDULER_KNOBS:
            known = ", ".join(sorted(SCHEDULER_KNOBS))
            raise TenantsError(f"[scheduler]: unknown knob {key!r} (known: {known})")
        types, word = SCHEDULER_KNOBS[key]
        _check_type("[scheduler]", key, value, types, word)
        if key == "ladder" and isinstance(value, str):
            if value not in ("default", "off"):
                raise TenantsError(f'[scheduler]: ladder = {value!r}: "default", "off" or rungs')
            value = [] if value == "off" else value
        out[key] = float(value) if SCHEDULER_KNOBS[key] is _NUM else value
    try:
        kvsched.SchedulerConfig(**out)
    except (kvsched.KvSchedError, TypeError, ValueError) as e:
        raise TenantsError(f"[scheduler]: {e}") from None
    return out


def load_scheduler_table(path: str | Path) -> dict[str, Any]:
    """The `[scheduler]` table of a tenants file (see `parse_scheduler_table`)."""
    return _read(path, parse_scheduler_table)


def parse_tenants(data: Mapping[str, Any]) -> list[TenantEntry]:
    """The tenants of a parsed TOML document (`{"tenant": [...]}`; a
    `[scheduler]` table beside them is `parse_scheduler_table`'s)."""
    for key in data:
        if key not in ("tenant", "scheduler", "fleet"):
            raise TenantsError(f"unknown top-level key {key!r}: tenants are [[tenant]] tables")
    tables = data.get("tenant")
    if not isinstance(tables, list) or not tables:
        raise TenantsError("no tenants: give at least one [[tenant]] table")
    entries = [_entry(i, t) for i, t in enumerate(tables)]
    names: set[str] = set()
    owner: dict[bytes, str] = {}
    for e in entries:
        if e.name in names:
            raise TenantsError(f"tenant {e.name!r}: the name appears twice")
        names.add(e.name)
        for d in e.key_digests:
            if d in owner:
                raise TenantsError(
                    f"tenant {e.name!r}: api_key is also a key of tenant {owner[d]!r}"
                )
            owner[d] = e.name
    return entries


def load_tenants(path: str | Path) -> list[TenantEntry]:
    """Read and check a tenants TOML file."""
    return _read(path, parse_tenants)


def _read(path: str | Path, parse: Callable[[Mapping[str, Any]], _T]) -> _T:
    """`parse` of a TOML file; TenantsError naming the file for every fault."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise TenantsError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise TenantsError(f"{path}: {e.strerror or e}") from None
    try:
        return parse(data)
    except TenantsError as e:
        raise TenantsError(f"{path}: {e}") from None


def _check_key(where: str, key: str) -> None:
    """A key a client can send as given: printable ASCII (an HTTP header's bytes
    are not UTF-8, so a non-ASCII key matched only a client that sent Latin-1),
    with no space at either end (the server strips the one it receives, so such
    a key never matched)."""
    bad = next((i for i, c in enumerate(key) if not " " <= c <= "~"), None)
    if bad is not None:  # its position only: an error never shows a key
        raise TenantsError(f"{where}: an api_key must be printable ASCII; character "
                           f"{bad + 1} of one is not")  # fmt: skip
    if key != key.strip():
        raise TenantsError(f"{where}: an api_key must not begin or end with a space "
                           "(clients' keys are read without them)")  # fmt: skip


@dataclass
class ReloadReport:
    """What `apply` / `reload` changed in the scheduler."""

    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    pending_removal: list[str] = field(default_factory=list)  # still has live requests
    errors: dict[str, str] = field(default_factory=dict)  # tenant -> why it was not applied
    keys_changed: list[str] = field(default_factory=list)  # API keys added or revoked

    def summary(self) -> str:
        parts = [f"{k} {', '.join(v)}" for k, v in (
            ("added", self.added), ("updated", self.updated), ("removed", self.removed),
            ("removal pending", self.pending_removal), ("API keys changed", self.keys_changed),
        ) if v]  # fmt: skip
        parts += [f"{name} not applied: {why}" for name, why in self.errors.items()]
        return "; ".join(parts) or "no changes"


class TenantRegistry:
    """API keys -> tenant names, kept in step with a scheduler's tenants."""

    def __init__(self, entries: Iterable[TenantEntry] = (), *, path: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._entries: dict[str, TenantEntry] = {}
        self._keys: tuple[tuple[bytes, str], ...] = ()
        self._pending: set[str] = set()  # removed from the file, still in the scheduler
        self._initial = list(entries)

    @classmethod
    def from_file(cls, path: str | Path) -> TenantRegistry:
        return cls(load_tenants(path), path=path)

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def entries(self) -> list[TenantEntry]:
        """The tenants applied, as the file gave them."""
        with self._lock:
            return list(self._entries.values())

    def authenticate(self, api_key: str | None) -> str | None:
        """The tenant whose key this is, or None. Compares against every key,
        whatever matches, in constant time per key (digests of equal length)."""
        if not api_key:
            return None
        probe = _digest(api_key)
        found = None
        for digest, name in self._keys:
            if hmac.compare_digest(probe, digest) and found is None:
                found = name
        return found

    def _publish(self) -> None:
        self._keys = tuple((d, e.name) for e in self._entries.values() for d in e.key_digests)

    def apply(self, scheduler: kvsched.Scheduler, entries: list[TenantEntry] | None = None,
              *, now: float | None = None) -> ReloadReport:  # fmt: skip
        """Make the scheduler's tenants those of `entries` (default: the ones the
        registry was built with): add new ones, update changed ones, remove the
        ones this registry added before and that are gone. A change the scheduler
        refuses is reported in `errors` and that tenant keeps its old settings."""
        entries = self._initial if entries is None else entries
        report = ReloadReport()
        with self._lock:
            new: dict[str, TenantEntry] = {}
            for e in entries:
                old = self._entries.get(e.name)
                try:
                    current = _scheduler_tenant(scheduler, e.name)
                    if current is None:
                        scheduler.add_tenant(e.config)
                        report.added.append(e.name)
                    elif current != e.config:
                        scheduler.update_tenant(e.config, now=now)
                        report.updated.append(e.name)
                    if old is not None and old.key_digests != e.key_digests:
                        report.keys_changed.append(e.name)
                    self._pending.discard(e.name)
                    new[e.name] = e
                except (kvsched.KvSchedError, ValueError) as err:
                    report.errors[e.name] = str(err)
                    if old is not None:
                        new[e.name] = old
            for name in self._entries:
                if name not in new:
                    self._pending.add(name)
            self._entries = new
            self._publish()
            self._retry(scheduler, report)
        return report

    def reload(self, scheduler: kvsched.Scheduler, *, now: float | None = None) -> ReloadReport:
        """Reread the file and apply it (a file that does not parse raises
        TenantsError and changes nothing)."""
        if self.path is None:
            raise TenantsError("this registry was not read from a file")
        return self.apply(scheduler, load_tenants(self.path), now=now)

    def retry_removals(self, scheduler: kvsched.Scheduler) -> ReloadReport:
        """Try again to remove tenants that had live requests."""
        report = ReloadReport()
        if self._pending:
            with self._lock:
                self._retry(scheduler, report)
        return report

    def _retry(self, scheduler: kvsched.Scheduler, report: ReloadReport) -> None:
        for name in sorted(self._pending):
            try:
                scheduler.remove_tenant(name)
            except kvsched.UnknownTenant:
                pass
            except kvsched.TenantInUse:
                report.pending_removal.append(name)
                continue
            self._pending.discard(name)
            report.removed.append(name)


def _scheduler_tenant(scheduler: kvsched.Scheduler, name: str) -> kvsched.TenantConfig | None:
    try:
        return scheduler.tenant(name)
    except kvsched.UnknownTenant:
        return None
