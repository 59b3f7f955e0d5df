"""Versions of the page's model, and the deltas between them.

At 1,000 nodes x 8 GPUs the whole model is ~2.5 MB; one grant changes a few nodes, a job, the
queue and the teams. So a page gets the whole model once (with its version) and then only what
changed, keyed by version: a delta names the version it applies to (`base`) and the one it makes
(`version`). A page that does not hold `base` refetches the whole model (`GET /api/state`).

Pure: no I/O, no clock. The keyed sections are diffed document by document; fields that only
move with the log's clock (GPU-seconds accrued, a pending job's wait) are left out of the
comparison, so a job is resent when it changed, not whenever time passed (the page extrapolates
them from `gpu_s` and `submitted_at`, as `readmodel.accounting` does).
"""

from __future__ import annotations

import gzip
from collections import deque
from typing import Any

import msgspec

from gpusched.readmodel import natural_key

#: Sections that are lists of documents keyed by one field: section -> (key, fields that move with time).
KEYED: dict[str, tuple[str, frozenset[str]]] = {
    "nodes": ("node", frozenset()),
    "running": ("job_id", frozenset({"gpu_s"})),
    "finished": ("job_id", frozenset({"gpu_s"})),
    "queue": ("job_id", frozenset({"waiting_s", "position"})),
}
#: Sections that are append-only series: section -> (the field that orders them, points kept).
SERIES: dict[str, tuple[str, int]] = {"tail": ("seq", 120), "shares": ("at", 1200)}
KEEP_DELTAS = 64


def _stable(doc: dict[str, Any], volatile: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in volatile} if volatile else doc


def index(model: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """The keyed sections of a model as {section: {key: the document's stable fields}}."""
    return {section: {doc[key]: _stable(doc, volatile) for doc in model.get(section, [])}
            for section, (key, volatile) in KEYED.items()}


def _keyed_changes(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]],
                   docs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    changed = [doc for doc in docs if old.get(doc[key]) != new[doc[key]]]
    gone = [k for k in old if k not in new]
    out: dict[str, Any] = {}
    if changed:
        out["set"] = changed
    if gone:
        out["del"] = gone
    return out


def _series_tail(old: list[dict[str, Any]], new: list[dict[str, Any]], field: str) -> list[dict[str, Any]]:
    """The points of `new` a holder of `old` lacks or holds stale (the last point may be rewritten)."""
    if not old:
        return list(new)
    last = old[-1][field]
    return [p for p in new if p[field] > last or (p[field] == last and p != old[-1])]


def diff(old: dict[str, Any], old_index: dict[str, dict[str, dict[str, Any]]],
         new: dict[str, Any], new_index: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """What turns model `old` into model `new` (`apply` on the page is its inverse)."""
    out: dict[str, Any] = {"kind": "delta", "base": old["version"], "version": new["version"]}
    for field, value in new.items():
        if field in KEYED or field in SERIES or field == "version":
            continue
        out[field] = value  # small sections (health, teams, counts) travel whole
    for section, (key, _) in KEYED.items():
        changes = _keyed_changes(old_index[section], new_index[section], new.get(section, []), key)
        if section == "queue":
            order = [doc[key] for doc in new.get(section, [])]
            if order != [doc[key] for doc in old.get(section, [])]:
                changes["order"] = order
        if changes:
            out[section] = changes
    for section, (field, _) in SERIES.items():
        points = _series_tail(old.get(section, []), new.get(section, []), field)
        if points:
            out[section] = points
    return out


def apply(model: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """The model `delta` makes from `model` (what the page's `applyDelta` does; the tests hold the
    two to `diff`). Raises `Stale` when `model` is not the version the delta applies to."""
    if delta["base"] != model["version"]:
        raise Stale(f"delta from version {delta['base']} does not apply to version {model['version']}")
    out = {k: v for k, v in model.items()}
    out.update({k: v for k, v in delta.items() if k not in KEYED and k not in SERIES and k not in ("kind", "base")})
    for section, (key, _) in KEYED.items():
        changes = delta.get(section)
        if not changes:
            continue
        docs = {doc[key]: doc for doc in model.get(section, [])}
        for gone in changes.get("del", []):
            docs.pop(gone, None)
        docs.update({doc[key]: doc for doc in changes.get("set", [])})
        order = list(changes.get("order") or [k for k in (doc[key] for doc in model.get(section, [])) if k in docs])
        placed = set(order)
        order += [k for k in docs if k not in placed]
        out[section] = [docs[k] for k in order]
    out["nodes"] = sorted(out.get("nodes", []), key=lambda doc: natural_key(doc["node"]))
    out["finished"] = sorted(out.get("finished", []), key=lambda doc: doc.get("finished_at") or 0.0, reverse=True)
    for section, (field, keep) in SERIES.items():
        points = list(model.get(section, []))
        for p in delta.get(section, []):
            if points and p[field] == points[-1][field]:
                points[-1] = p
            elif not points or p[field] > points[-1][field]:
                points.append(p)
        out[section] = points[-keep:]
    return out


class Stale(ValueError):
    """A delta for another version than the one held: refetch the whole model."""


class Versions:
    """The latest whole model and the deltas between the last `keep` versions."""

    def __init__(self, keep: int = KEEP_DELTAS, epoch: str = ""):
        self.epoch = epoch  # names this server's run: a version held from another one is unknown here
        self.version = -1
        self.model: dict[str, Any] | None = None
        self._full: bytes | None = None
        self._gzipped: bytes | None = None
        self._index: dict[str, dict[str, dict[str, Any]]] = {}
        self.deltas: deque[tuple[int, int, bytes]] = deque(maxlen=keep)  # (base, version, encoded)

    def publish(self, model: dict[str, Any]) -> None:
        """Make `model` (with its `version`, above the last) the latest one."""
        new_index = index(model)
        if self.model is not None:
            delta = diff(self.model, self._index, model, new_index)
            self.deltas.append((self.model["version"], model["version"], msgspec.json.encode(delta)))
        self.model, self._index, self.version = model, new_index, model["version"]
        self._full = self._gzipped = None

    @property
    def full(self) -> bytes:
        """The whole model, encoded once per version and only when a page asks for it."""
        if self._full is None:
            self._full = msgspec.json.encode({"kind": "full", "epoch": self.epoch, **(self.model or {})})
        return self._full

    def gzipped(self) -> bytes:
        """The whole model, gzipped once per version however many pages load it."""
        if self._gzipped is None:
            self._gzipped = gzip.compress(self.full, compresslevel=5)
        return self._gzipped

    def event_id(self, version: int) -> str:
        return f"{self.epoch}-{version}"

    def held(self, event_id: str | None) -> int | None:
        """The version an event id of this run names (None: another run's, or no id)."""
        epoch, _, version = (event_id or "").rpartition("-")
        if epoch != self.epoch or not version.isdigit():
            return None
        return int(version)

    def since(self, version: int | None) -> list[tuple[int, bytes]] | None:
        """The deltas that bring a holder of `version` to the latest, oldest first, as
        (version, encoded); [] when it is current; None when they are gone (send it the whole model)."""
        if version is None:
            return None
        if version == self.version:
            return []
        chain: list[tuple[int, bytes]] = []
        for base, ver, data in self.deltas:
            if chain or base == version:
                chain.append((ver, data))
        return chain or None
