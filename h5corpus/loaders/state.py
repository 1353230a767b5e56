"""The loaders' checkpoint state: small, constant-size, plain values, validated field by field.

A state says where the global sequence of microbatches (:mod:`~h5corpus.loaders.partition`)
stands, never which process read what::

    {"version": 2, "loader": "BestFitDataset", "fingerprint": "<64 hex>",
     "settings": {...},            # the loader settings the sequence depends on (plain values)
     "epoch": 3,
     "position": 1200,             # global microbatches consumed by all ranks in this epoch
     "tokens": 171_372_544,        # input tokens in those microbatches
     "source_tokens": [...],       # the same per mixture source (one entry for a single corpus)
     "writer": {"rank": 0, "world_size": 4, "worker": 1, "num_workers": 2,
                "start": 800, "yielded": 50}}

Only Python ints, strs, bools, floats, lists and dicts: ``torch.load(..., weights_only=True)``
restores a checkpoint holding it. ``writer`` is who wrote it: the iteration's start position, and how
many microbatches this consumer yielded since. With one consumer per rank (``num_workers == 1``)
``position = start + world_size * yielded`` is exact and continues on any cluster shape. A single
DataLoader worker's state only bounds the rank's position (the other workers' progress is not in
it); it continues exactly on the same shape (``StatefulDataLoader.load_state_dict``), and
:func:`merge_dataloader_state` turns a whole ``StatefulDataLoader.state_dict()`` into an exact
state (the last microbatch the rank delivered is the workers' furthest).

:func:`parse_state` checks every field's presence, type and range and the writer's arithmetic,
raising :class:`LoaderStateError` naming the field; the dataset then checks the position against
its epoch and the tokens against its plan (docs/PACKING.md, "State").
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: How deep a settings value may nest (lists / dicts); the loaders' own settings nest 2 levels.
MAX_DEPTH = 8


def show(value: Any) -> str:
    """A short, bounded repr of a user-given value for an error message (any nesting depth)."""
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlist, r.maxdict = 3, 60, 60, 6, 6
    return r.repr(value)


#: Version of the state layout and of the rules that map it to microbatches (order, chunking,
#: packing, schedule); a state of another version is refused, never continued elsewhere.
STATE_VERSION = 2

STATE_FIELDS = (
    "version",
    "loader",
    "fingerprint",
    "settings",
    "epoch",
    "position",
    "tokens",
    "source_tokens",
    "writer",
)
WRITER_FIELDS = ("rank", "world_size", "worker", "num_workers", "start", "yielded")


class LoaderStateError(ValueError):
    """A loader state that cannot be continued; the message names the field."""


@dataclass(frozen=True)
class Writer:
    """Who wrote a state: consumer ``worker`` of ``num_workers`` on rank ``rank`` of ``world_size``,
    in an iteration that started at global position ``start`` and yielded ``yielded`` since."""

    rank: int
    world_size: int
    worker: int
    num_workers: int
    start: int
    yielded: int

    def position(self) -> int:
        """The global position this writer vouches for: after its last yielded item's step."""
        if not self.yielded:
            return self.start
        return self.start + self.world_size * (self.worker + self.num_workers * (self.yielded - 1) + 1)


@dataclass(frozen=True)
class LoaderState:
    """A parsed, structurally valid state (:func:`parse_state`)."""

    loader: str
    fingerprint: str
    settings: dict[str, Any]
    epoch: int
    position: int
    tokens: int
    source_tokens: tuple[int, ...]
    writer: Writer

    @property
    def exact(self) -> bool:
        """True when ``position`` is the rank's (one consumer per rank), not one worker's bound."""
        return self.writer.num_workers == 1

    def as_dict(self) -> dict[str, Any]:
        w = self.writer
        return {
            "version": STATE_VERSION,
            "loader": self.loader,
            "fingerprint": self.fingerprint,
            "settings": dict(self.settings),
            "epoch": self.epoch,
            "position": self.position,
            "tokens": self.tokens,
            "source_tokens": list(self.source_tokens),
            "writer": {f: getattr(w, f) for f in WRITER_FIELDS},
        }


def _fail(field: str, why: str) -> LoaderStateError:
    return LoaderStateError(f"loader state field {field!r}: {why}")


def _int(d: Mapping[str, Any], key: str, where: str, lo: int = 0) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(where, f"must be an integer, got {type(v).__name__} {show(v)}")
    if v < lo:
        raise _fail(where, f"must be >= {lo}, got {v:,}")
    return v


def _fields(d: Any, names: tuple[str, ...], where: str) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise _fail(where or "state", f"must be a dict, got {type(d).__name__}")
    prefix = f"{where}." if where else ""
    for k in names:
        if k not in d:
            raise _fail(prefix + k, "missing")
    extra = sorted(str(k) for k in d if k not in names)
    if extra:
        raise _fail(prefix + extra[0], "not a field of this state version")
    return d


def parse_state(state: Any, *, loader: str, num_sources: int) -> LoaderState:
    """Check every field of ``state`` (presence, type, range, the writer's arithmetic, the
    per-source tokens' sum); raise :class:`LoaderStateError` naming the first bad one."""
    if isinstance(state, Mapping) and "version" in state and state["version"] != STATE_VERSION:
        raise _fail(
            "version",
            f"{show(state['version'])}; this h5corpus reads version {STATE_VERSION} (an older plan cannot resume)",
        )
    d = _fields(state, STATE_FIELDS, "")
    if d["loader"] != loader:
        raise _fail("loader", f"the state is a {show(d['loader'])}'s, this is a {loader!r}")
    fp = d["fingerprint"]
    if not isinstance(fp, str) or len(fp) != 64 or any(ch not in "0123456789abcdef" for ch in fp):
        raise _fail("fingerprint", f"must be 64 lowercase hex digits, got {show(fp)}")
    if not isinstance(d["settings"], Mapping):
        raise _fail("settings", f"must be a dict, got {type(d['settings']).__name__}")
    for k, v in d["settings"].items():
        _check_plain(v, f"settings.{k}", 1)
    w = _fields(d["writer"], WRITER_FIELDS, "writer")
    writer = Writer(
        rank=_int(w, "rank", "writer.rank"),
        world_size=_int(w, "world_size", "writer.world_size", 1),
        worker=_int(w, "worker", "writer.worker"),
        num_workers=_int(w, "num_workers", "writer.num_workers", 1),
        start=_int(w, "start", "writer.start"),
        yielded=_int(w, "yielded", "writer.yielded"),
    )
    if writer.rank >= writer.world_size:
        raise _fail("writer.rank", f"{writer.rank} outside [0, {writer.world_size})")
    if writer.worker >= writer.num_workers:
        raise _fail("writer.worker", f"{writer.worker} outside [0, {writer.num_workers})")
    position = _int(d, "position", "position")
    if position != writer.position():
        raise _fail(
            "position", f"{position:,} disagrees with its writer (start and yielded give {writer.position():,})"
        )
    tokens = _int(d, "tokens", "tokens")
    src = d["source_tokens"]
    if not isinstance(src, list) or len(src) != num_sources:
        raise _fail("source_tokens", f"must be a list of {num_sources} integers, got {show(src)}")
    per = tuple(_int(dict(enumerate(src)), i, f"source_tokens[{i}]") for i in range(num_sources))
    if sum(per) != tokens:
        raise _fail("source_tokens", f"sum to {sum(per):,}, but tokens is {tokens:,}")
    return LoaderState(loader, fp, dict(d["settings"]), _int(d, "epoch", "epoch"), position, tokens, per, writer)


def _check_plain(v: Any, where: str, depth: int) -> None:
    """Refuse a settings value that is not plain data nested at most :data:`MAX_DEPTH` levels."""
    if depth > MAX_DEPTH:
        raise _fail(where, f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(v, (list, tuple)):
        for x in v:
            _check_plain(x, where, depth + 1)
    elif isinstance(v, Mapping):
        for x in v.values():
            _check_plain(x, where, depth + 1)
    elif v is not None and not isinstance(v, (bool, int, float, str)):
        raise _fail(where, f"must be plain data (int, float, str, bool, None, list, dict), got {type(v).__name__}")


def _same(a: Any, b: Any) -> bool:
    """Equal values of equal types, recursively (``True != 1`` and ``1.0 != 1`` here)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def mismatches(st: LoaderState, fingerprint: str, settings: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(field, description)`` of every field where ``st`` differs from this dataset."""
    out = []
    if st.fingerprint != fingerprint:
        out.append(("fingerprint", f"saved {st.fingerprint[:12]}..., this corpus {fingerprint[:12]}..."))
    for k in sorted(set(settings) | set(st.settings)):
        if k not in st.settings:
            out.append((k, "missing from the saved settings"))
        elif k not in settings:
            out.append((k, f"saved {show(st.settings[k])}, not a setting of this loader"))
        elif not _same(st.settings[k], settings[k]):
            out.append((k, f"saved {show(st.settings[k])}, this dataset has {show(settings[k])}"))
    return out


def check_identity(
    st: LoaderState, fingerprint: str, settings: Mapping[str, Any], allow_mismatch: Iterable[str]
) -> bool:
    """Refuse a state of another corpus or other settings unless each differing field is in
    ``allow_mismatch`` ("fingerprint" or a setting's name). Returns True if anything differed
    (then the dataset continues by tokens, not by position)."""
    allowed = set(allow_mismatch)
    diff = mismatches(st, fingerprint, settings)
    refused = [(k, why) for k, why in diff if k not in allowed]
    if refused:
        k, why = refused[0]
        name = "fingerprint" if k == "fingerprint" else f"settings.{k}"
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise _fail(
            name,
            f"{why}{more}; a state continues only the same corpus and settings "
            f"(load_state_dict(..., allow_mismatch=[{k!r}]) continues by tokens consumed instead)",
        )
    return bool(diff)


def merge_dataloader_state(state: Any) -> Any:
    """A dataset state from ``state``: a dataset state passes through; a torchdata
    ``StatefulDataLoader.state_dict()`` gives its dataset's state (in-process) or the furthest of
    its workers' states, made exact (one consumer per rank, at the rank's position): the DataLoader
    hands over worker items in rank order, so the last item it delivered is the furthest any worker
    vouches for. The workers must agree on everything but their progress."""
    if not isinstance(state, Mapping) or "version" in state:
        return state
    if "dataset_state" in state and "fetcher_state" in state:  # in-process StatefulDataLoader
        return state["dataset_state"]
    if "_snapshot" not in state:
        return state  # a loader state (parse_state names what is wrong with it)
    snaps = state["_snapshot"].get("_worker_snapshots") if isinstance(state["_snapshot"], Mapping) else None
    if not isinstance(snaps, Mapping) or not snaps:
        raise _fail("_snapshot", "a StatefulDataLoader state_dict() without worker states")
    parts = []
    for key in sorted(snaps, key=str):
        ws = snaps[key].get("dataset_state") if isinstance(snaps[key], Mapping) else None
        if not isinstance(ws, Mapping) or "writer" not in ws or not isinstance(ws["writer"], Mapping):
            raise _fail(f"_worker_snapshots.{key}", "holds no h5corpus loader state")
        parts.append(ws)
    return _merge_workers(parts)


def _merge_workers(parts: list[Mapping[str, Any]]) -> dict[str, Any]:
    ref = parts[0]
    same = ("version", "loader", "fingerprint", "settings", "epoch")
    for p in parts[1:]:
        for k in same:
            if not _same(p.get(k), ref.get(k)):
                raise _fail(k, "DataLoader workers' states disagree")
        for k in ("world_size", "num_workers", "start", "rank"):
            if not _same(p["writer"].get(k), ref["writer"].get(k)):
                raise _fail(f"writer.{k}", "DataLoader workers' states disagree")
    n = ref["writer"].get("num_workers")
    workers = sorted(p["writer"].get("worker") for p in parts if isinstance(p["writer"].get("worker"), int))
    if workers != list(range(len(parts))) or n != len(parts):
        raise _fail("writer.worker", f"expected the states of workers 0..{show(n)} - 1, got {workers}")
    top = max(parts, key=lambda p: p.get("position") if isinstance(p.get("position"), int) else -1)
    w = dict(top["writer"])
    W, start, pos = w["world_size"], w["start"], top.get("position")
    if not isinstance(pos, int) or not isinstance(W, int) or not isinstance(start, int) or W < 1 or (pos - start) % W:
        raise _fail(
            "position", f"{show(pos)} is not a whole number of steps from start {show(start)} on {show(W)} ranks"
        )
    merged = dict(top)
    merged["writer"] = {**w, "worker": 0, "num_workers": 1, "yielded": (pos - start) // W}
    return merged
