"""Hostile loader states: every field of a loaded state is checked against the corpus and settings,
and a bad one is refused with the field named (never a bare KeyError, never continuing wrongly).

Each garbled state is made from a real mid-epoch state of both loaders; after a refusal the dataset
still plays its epoch from the start. Valid states at every position continue with the right batch.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch

from h5corpus import BestFitDataset, LoaderStateError, SlidingWindowDataset, open_corpus
from h5corpus.loaders.state import STATE_FIELDS, WRITER_FIELDS
from tests.helpers import BYTE_IDENTITY, batch_digest, byte_encode, stdlib_texts, write_corpus

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

LOADERS = {
    "bestfit": lambda c, **kw: BestFitDataset(c, 512, 4, 32, seed=2, **kw),
    "window": lambda c, **kw: SlidingWindowDataset(c, 600, 4, seed=2, **kw),
}


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    root = tmp_path_factory.mktemp("state-corpus")
    return write_corpus(root, stdlib_texts(120), byte_encode, BYTE_IDENTITY, chunk_tokens=4096, shard_tokens=300_000)


@pytest.fixture(scope="module")
def references(manifest):
    """Per loader: (digests of the whole epoch, a valid state after 5 microbatches)."""
    out = {}
    for name, make in LOADERS.items():
        corpus = open_corpus(manifest, "train")
        ds = make(corpus)
        ref = [batch_digest(b) for b in make(corpus)]
        it = iter(ds)
        for _ in range(5):
            next(it)
        out[name] = (ref, ds.state_dict())
    return out


def _set(path: str, value):
    def mutate(st):
        keys = path.split(".")
        d = st
        for k in keys[:-1]:
            d = d[k]
        if value is _DELETE:
            del d[keys[-1]]
        else:
            d[keys[-1]] = value(d[keys[-1]]) if callable(value) else value

    return mutate


_DELETE = object()


def _consistent(delta: int):
    """Move position and the writer's count together (the writer arithmetic stays right)."""

    def mutate(st):
        st["writer"]["yielded"] += delta
        st["position"] += delta

    return mutate


# (case id, mutation, the field the error must name)
CASES = (
    [(f"missing-{f}", _set(f, _DELETE), f) for f in STATE_FIELDS]
    + [(f"missing-writer-{f}", _set(f"writer.{f}", _DELETE), f"writer.{f}") for f in WRITER_FIELDS]
    + [
        ("extra-field", _set("order", [0] * 10), "order"),
        ("extra-writer-field", _set("writer.cursor", 3), "writer.cursor"),
        ("version-1", _set("version", 1), "version"),
        ("version-str", _set("version", "2"), "version"),
        ("other-loader", _set("loader", "SomethingElse"), "loader"),
        ("fingerprint-garbage", _set("fingerprint", "zz"), "fingerprint"),
        ("fingerprint-int", _set("fingerprint", 12), "fingerprint"),
        ("fingerprint-other", _set("fingerprint", "a" * 64), "fingerprint"),
        ("settings-list", _set("settings", [1, 2]), "settings"),
        ("settings-seed", _set("settings.seed", 3), "settings.seed"),
        ("settings-float", _set("settings.batch_size", 4.0), "settings.batch_size"),
        ("settings-bool-for-int", _set("settings.drop_last", 0), "settings.drop_last"),
        ("settings-missing", _set("settings.seed", _DELETE), "settings.seed"),
        ("settings-extra", _set("settings.cursor", 1), "settings.cursor"),
        ("epoch-negative", _set("epoch", -1), "epoch"),
        ("epoch-fraction", _set("epoch", 0.5), "epoch"),
        ("epoch-str", _set("epoch", "0"), "epoch"),
        ("epoch-bool", _set("epoch", False), "epoch"),
        ("position-negative", _set("position", -5), "position"),
        ("position-fraction", _set("position", 4.5), "position"),
        ("position-float-int", _set("position", 5.0), "position"),
        ("position-none", _set("position", None), "position"),
        ("position-vs-writer", _set("position", lambda p: p + 1), "position"),
        ("position-past-end", _consistent(10**6), "position"),
        ("tokens-negative", _set("tokens", -1), "tokens"),
        ("tokens-float", _set("tokens", lambda t: float(t)), "tokens"),
        (
            "tokens-off-by-one",
            lambda st: (_set("tokens", lambda t: t + 1)(st), _set("source_tokens", lambda s: [s[0] + 1])(st)),
            "tokens",
        ),
        ("tokens-stale", _consistent(2), "tokens"),
        ("source-tokens-sum", _set("source_tokens", lambda s: [s[0] + 3]), "source_tokens"),
        ("source-tokens-length", _set("source_tokens", lambda s: s + [0]), "source_tokens"),
        ("source-tokens-type", _set("source_tokens", "many"), "source_tokens"),
        ("source-tokens-entry", _set("source_tokens", lambda s: [float(s[0])]), "source_tokens[0]"),
        ("writer-not-dict", _set("writer", 7), "writer"),
        ("writer-rank", _set("writer.rank", 1), "writer.rank"),
        ("writer-world-size-0", _set("writer.world_size", 0), "writer.world_size"),
        ("writer-worker", _set("writer.worker", 1), "writer.worker"),
        ("writer-num-workers-0", _set("writer.num_workers", 0), "writer.num_workers"),
        ("writer-yielded-negative", _set("writer.yielded", -2), "writer.yielded"),
        ("writer-yielded-fraction", _set("writer.yielded", 2.5), "writer.yielded"),
        (
            "writer-start-past-end",
            lambda st: (_set("writer.start", 10**6)(st), _set("position", 10**6 + 5)(st)),
            "writer.start",
        ),
    ]
)


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("case, mutate, field", CASES, ids=[c[0] for c in CASES])
def test_garbled_state_is_refused_naming_the_field(manifest, references, loader, case, mutate, field):
    ref, good = references[loader]
    st = copy.deepcopy(good)
    mutate(st)
    ds = LOADERS[loader](open_corpus(manifest, "train"))
    with pytest.raises(LoaderStateError, match=f"loader state field '{re.escape(field)}'"):
        ds.load_state_dict(st)
    assert isinstance(LoaderStateError("x"), ValueError)
    assert batch_digest(next(iter(ds))) == ref[0], "a refused state changed where the dataset starts"


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize(
    "junk", [None, [1, 2], "state", 7, torch.zeros(3)], ids=["none", "list", "str", "int", "tensor"]
)
def test_a_non_state_is_refused(manifest, loader, junk):
    with pytest.raises(LoaderStateError, match="loader state field"):
        LOADERS[loader](open_corpus(manifest, "train")).load_state_dict(junk)


def test_the_old_state_format_is_refused_by_version(manifest):
    """A checkpoint of the previous per-consumer plan (order array, cursor, buffer, no version
    field) is refused by name, not continued."""
    old = {
        "plan_version": 1,
        "fingerprint": "0" * 64,
        "config": {},
        "started": True,
        "epoch": 0,
        "consumer": (0, 1),
        "order": torch.zeros(10, dtype=torch.int64),
        "plan": {"cursor": 0},
        "batches_yielded": 1,
        "tokens_yielded": 5,
    }
    with pytest.raises(LoaderStateError, match="loader state field 'version': missing"):
        LOADERS["bestfit"](open_corpus(manifest, "train")).load_state_dict(old)


@pytest.mark.parametrize("loader", list(LOADERS))
def test_every_valid_position_continues_with_its_batch(manifest, references, loader):
    """States at positions 0, 1, ..., M (written by seek, then saved) all load and continue with
    microbatch ``position`` (none at M)."""
    ref, _ = references[loader]
    corpus = open_corpus(manifest, "train")
    for P in sorted({0, 1, 2, len(ref) // 3, len(ref) - 1, len(ref)}):
        src = LOADERS[loader](corpus)
        src.seek(P)
        st = src.state_dict()
        assert st["position"] == P
        ds = LOADERS[loader](corpus)
        ds.load_state_dict(st)
        got = [batch_digest(b) for b in ds]
        assert got == ref[P:]


@pytest.mark.parametrize("loader", list(LOADERS))
def test_allow_mismatch_continues_by_tokens(manifest, references, loader):
    """Another batch size is refused by name unless allowed; allowed, the new run starts at its
    first microbatch after which at least the saved tokens are consumed."""
    _, st = references[loader]
    corpus = open_corpus(manifest, "train")
    make = LOADERS[loader]
    other = (
        (lambda: BestFitDataset(corpus, 512, 6, 32, seed=2))
        if loader == "bestfit"
        else (lambda: SlidingWindowDataset(corpus, 600, 6, seed=2))
    )
    with pytest.raises(LoaderStateError, match="settings.batch_size"):
        other().load_state_dict(st)
    full = list(other())
    cum = np.cumsum([0] + [b.num_tokens for b in full])
    P = int(np.searchsorted(cum, st["tokens"], side="left"))
    ds = other()
    ds.load_state_dict(st, allow_mismatch=["batch_size"])
    assert ds.state_dict()["position"] == P
    assert batch_digest(next(iter(ds))) == batch_digest(full[P])
    assert make(corpus).state_dict()["position"] == 0


@pytest.mark.parametrize("loader", list(LOADERS))
def test_dataloader_worker_states(manifest, references, loader):
    """A StatefulDataLoader state: loaded whole into a dataset it continues on any worker count;
    a single worker's state on another shape is refused naming 'writer'; workers whose states
    disagree, or a garbled worker state, are refused by field."""
    ref, _ = references[loader]
    corpus = open_corpus(manifest, "train")
    make = LOADERS[loader]
    dl = StatefulDataLoader(make(corpus), batch_size=None, num_workers=2)
    it = iter(dl)
    for _ in range(5):
        next(it)
    state = dl.state_dict()
    del it, dl
    ds = make(corpus)
    ds.load_state_dict(state)
    assert ds.state_dict()["position"] == 5 and batch_digest(next(iter(ds))) == ref[5]
    worker1 = state["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"]
    lone = make(corpus)
    lone.load_state_dict(worker1)
    with pytest.raises(LoaderStateError, match="loader state field 'writer'"):
        next(iter(lone))
    bad = copy.deepcopy(state)
    bad["_snapshot"]["_worker_snapshots"]["worker_0"]["dataset_state"]["epoch"] = 4
    with pytest.raises(LoaderStateError, match="loader state field 'epoch'.*disagree"):
        make(corpus).load_state_dict(bad)
    bad = copy.deepcopy(state)
    del bad["_snapshot"]["_worker_snapshots"]["worker_1"]
    with pytest.raises(LoaderStateError, match="loader state field 'writer.worker'"):
        make(corpus).load_state_dict(bad)
    bad = copy.deepcopy(state)
    for w in ("worker_0", "worker_1"):
        bad["_snapshot"]["_worker_snapshots"][w]["dataset_state"]["tokens"] += 1
    with pytest.raises(LoaderStateError, match="loader state field '(tokens|source_tokens)'"):
        make(corpus).load_state_dict(bad)
