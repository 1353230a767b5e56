"""``h5corpus`` command line: a thin layer over the library.

Exit codes: 0 success; 1 the work could not be completed: the data is bad (corruption, a failed
check, bad input) or the OS refused a write (disk full, read-only or unwritable output, I/O
error), and what was completed is kept; 2 usage error (missing file, bad option, a path of the
wrong kind: a folder where a file goes or a file where a folder goes). Every error is one line on
stderr (``error: ...``) naming the path and what failed.
"""

from __future__ import annotations

import errno
import inspect
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperCommand, TyperOption

from .build import (
    BuildConfig,
    BuildConflict,
    BuildError,
    BuildReport,
    build_corpus,
    format_report,
    parse_byte_size,
    parse_max_tokens,
)
from .build.config import EXECUTORS, RayOptions, SlurmOptions
from .build.input.sources import SourceError
from .build.oserrors import BuildOSError
from .build.stages.dispatch import main_stage, stage_status
from .build.tokenize.tokenizer import TokenizerError
from .filters import DocumentFilter, FilterConfig, parse_lang_codes
from .filters.perplexity import MAX_ORDER, ModelFileError
from .qualitymodel import BadReference, score_sources, train_from_sources
from .storage.format import FormatError
from .storage.manifest import DEFAULT_MANIFEST
from .storage.validate import validate_corpus

EXIT_OK = 0
EXIT_BAD_DATA = 1
EXIT_USAGE = 2

app = typer.Typer(
    name="h5corpus",
    help="Tokenize raw text into sharded, verifiable HDF5 corpora; validate and inspect them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class FlagHelpCommand(TyperCommand):
    """A command whose help shows no value type beside flags (typer prints ``<bool>`` beside an
    option such as ``--validate``, which takes no value)."""

    def get_params(self, ctx: typer.Context) -> list[Any]:
        params = super().get_params(ctx)
        for p in params:
            if isinstance(p, TyperOption) and p.is_flag and p.metavar is None:
                p.metavar = ""
        return params


@app.callback()
def _root() -> None:
    """Tokenize raw text into sharded, verifiable HDF5 corpora; validate and inspect them."""


def fail(message: str, code: int) -> typer.Exit:
    """Print ``message`` to stderr and return the Exit to raise."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def check_path_arg(option: str, path: Path | None) -> None:
    """Refuse a path argument the OS would cut short (a NUL byte ends a C string) or cannot look up
    at all (a name longer than the file-system's limit, a folder without permission)."""
    if path is not None and "\0" in str(path):
        raise fail(f"{option}: {str(path)!r} holds a NUL byte", EXIT_USAGE)
    if path is not None:
        try:
            os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            pass  # the checks of each command name these
        except OSError as e:
            raise fail(f"{option}: {path}: {e.strerror or e}", EXIT_USAGE) from None


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/")


def manifest_url(manifest: Path) -> str | None:
    """The object-storage URL a MANIFEST argument spells (``s3://b/k`` arrives as ``s3:/b/k``), or
    None for a local path."""
    from .storage.remote import is_remote

    text = str(manifest)
    if _URL.match(text) and not text.split(":", 1)[1].startswith("//"):
        text = text.replace(":/", "://", 1)
    return text if is_remote(text) else None


def check_local_manifest(manifest: Path) -> None:
    """Refuse object-storage URLs up front (``s3://...`` arrives here as ``s3:/...``)."""
    if _URL.match(str(manifest)):
        scheme = str(manifest).split(":", 1)[0]
        raise fail(
            f"{scheme}:// manifests are not supported: object storage has no SWMR or memory maps; copy or "
            "mount the corpus (manifest and shards) on a local or network filesystem and pass that path",
            EXIT_USAGE,
        )


def check_output_file(option: str, path: Path | None) -> None:
    """Before any work: ``path`` must be a file that can be written (exit 2 for a folder or a path
    below a file, 1 when the OS would refuse the write)."""
    if path is None:
        return
    if path.is_dir():
        raise fail(f"{option} {path} is a folder, not a file", EXIT_USAGE)
    if path.exists() and not path.is_file():
        raise fail(f"{option} {path} is not a regular file", EXIT_USAGE)
    folder = path.absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise fail(f"{option} {path}: {folder} is not a folder", EXIT_USAGE)
    target = path if path.exists() else folder
    if not os.access(target, os.W_OK) or not os.access(folder, os.W_OK | os.X_OK):
        try:
            ro = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
        except OSError:
            ro = False
        err = errno.EROFS if ro else errno.EACCES
        raise fail(f"cannot write {option} {path}: {os.strerror(err)} [{errno.errorcode[err]}]", EXIT_BAD_DATA)


def os_failure(what: str, e: OSError) -> typer.Exit:
    """A failed system call the library did not name: one line with the path, exit 1."""
    name = errno.errorcode.get(e.errno or 0, "")
    path = f" {e.filename}" if e.filename else ""
    return fail(f"cannot {what}{path}: {e.strerror or e}" + (f" [{name}]" if name else ""), EXIT_BAD_DATA)


def check_positive(option: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise fail(f"{option} must be >= 1, got {value}", EXIT_USAGE)


def print_validation(report, as_json: bool) -> int:
    """Print a ValidationReport (one line per failing shard) and return the exit code."""
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2, sort_keys=True))
    else:
        for f in report.findings:
            typer.echo(f"FAIL {f}", err=not as_json)
        status = "OK" if report.ok else f"CORRUPT ({len(report.failing_shards)} shard(s) failing)"
        typer.echo(
            f"validate {report.manifest}: {status}: {report.shards} shards, {report.tokens:,} tokens, "
            f"{report.bytes_hashed:,} bytes hashed"
        )
    return EXIT_OK if report.ok else EXIT_BAD_DATA


@app.command("validate")
def validate_cli(
    manifest: Path = typer.Argument(DEFAULT_MANIFEST, help="Path to shards.json, or its URL (s3://...)."),
    workers: int | None = typer.Option(None, "--workers", "-w", help="Shards hashed at once (default: all cores)."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable report."),
    deep: bool = typer.Option(
        False, "--deep", help="Also scan every token: ids < vocab_size, no EOS inside a document (about 20% more CPU)."
    ),
    write_layout: bool = typer.Option(
        False,
        "--write-layout",
        help="When every check passes, (re)write the reader caches beside the manifest: the layout file "
        "(<manifest>.layout: readers' first touches skip HDF5) and the table file (<manifest>.table: readers open "
        "without parsing the manifest). A build writes both; this is for corpora built before, copied, or touched.",
    ),
) -> None:
    """Recompute every shard's sha256 in parallel and check structure. Exit 1 naming each failing shard."""

    check_positive("--workers", workers)
    url = manifest_url(manifest)
    if url is not None and write_layout:
        raise fail(
            "--write-layout needs a local manifest (a remote corpus's cached shards are checked as they land)",
            EXIT_USAGE,
        )
    if url is not None:  # through the node cache (docs/READING.md, "Corpora on object storage")
        from .storage.mirror import validate_remote

        try:
            report = validate_remote(url, workers=workers, deep=deep)
        except (FormatError, ImportError) as e:
            raise fail(str(e), EXIT_BAD_DATA) from None
        raise typer.Exit(print_validation(report, as_json))
    check_path_arg("MANIFEST", manifest)
    check_local_manifest(manifest)
    if not manifest.exists():
        raise fail(f"{manifest}: manifest not found", EXIT_USAGE)
    report = validate_corpus(manifest, workers=workers, progress=sys.stderr.isatty() and not as_json, deep=deep)
    code = print_validation(report, as_json)
    if write_layout and code == 0:
        from .storage.manifest import write_table_file
        from .storage.reader import write_layout_file

        typer.echo(f"wrote {write_layout_file(manifest)}", err=as_json)
        try:
            typer.echo(f"wrote {write_table_file(manifest)}", err=as_json)
        except FormatError as e:
            raise fail(str(e), EXIT_BAD_DATA) from None
    raise typer.Exit(code)


def _check_inspect_args(
    manifest: Path,
    output: Path | None,
    plot: Path | None,
    mode: str,
    *,
    seq_len: int,
    batch_size: int,
    buffer: int | None,
) -> None:
    """``inspect``'s usage checks, before any work (exit 2, or 1 for an output the OS refuses)."""
    remote = manifest_url(manifest) is not None
    for name, path in (("MANIFEST", None if remote else manifest), ("--output", output), ("--plot", plot)):
        check_path_arg(name, path)
    for name, value in (("--seq-len", seq_len), ("--batch-size", batch_size), ("--packing-buffer", buffer)):
        check_positive(name, value)
    if not remote:
        check_local_manifest(manifest)
    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise fail(
                "--plot needs matplotlib: pip install 'h5corpus[plot]' (or pip install matplotlib)", EXIT_USAGE
            ) from None
    for name, path in (("--output", output), ("--plot", plot)):
        check_output_file(name, path)
    if not remote and not manifest.exists():
        raise fail(f"{manifest}: manifest not found", EXIT_USAGE)
    if mode not in ("buffer", "bfd"):
        raise fail(f"--mode must be buffer or bfd, got {mode!r}", EXIT_USAGE)


def _write_inspection(rep: Any, data: str, output: Path | None, plot: Path | None) -> None:
    """Write ``--output`` (the JSON ``data``) and ``--plot`` when given."""
    try:
        if output:
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(data + "\n")
    except OSError as e:
        raise os_failure("write --output", e if e.filename else OSError(e.errno, e.strerror, str(output))) from None
    # The commands that read batches import the loaders (and with them torch, ~2 s) when they run,
    # so that build, validate and --help start without it.
    from .inspection import plot_report

    try:
        if plot:
            plot_report(rep, plot)
    except OSError as e:
        raise os_failure("write --plot", e if e.filename else OSError(e.errno, e.strerror, str(plot))) from None


@app.command("inspect")
def inspect_cli(
    manifest: Path = typer.Argument(DEFAULT_MANIFEST, help="Path to shards.json, or its URL (s3://...)."),
    split: list[str] | None = typer.Option(None, "--split", help="Split(s) to inspect (default: all present)."),
    seq_len: int = typer.Option(4096, "--seq-len", help="Independent context limit, in input tokens."),
    batch_size: int = typer.Option(35, "--batch-size", help="Packs per microbatch."),
    packing_buffer: int | None = typer.Option(
        None, "--packing-buffer", help="Candidate buffer, in chunks (default 64 for buffer, 16,384 for bfd)."
    ),
    mode: str = typer.Option("buffer", "--mode", help="Packing mode: buffer or bfd."),
    seed: int = typer.Option(0, "--seed", help="Sampler seed for the packing simulation and checks."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON instead of the table."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Also write the JSON figures to this file."),
    plot: Path | None = typer.Option(
        None, "--plot", help="Write a PNG: length histogram, pack fill, tokens per split."
    ),
) -> None:
    """Counts, statistics, pack fill and the seed's data checks. Exit 1 if any check fails.

    CREATES: --output JSON and --plot PNG when given; nothing else.
    """

    from .inspection import format_report as format_inspection
    from .inspection import inspect_corpus  # loaders and torch: only for the commands that read batches

    _check_inspect_args(manifest, output, plot, mode, seq_len=seq_len, batch_size=batch_size, buffer=packing_buffer)
    url, local = manifest_url(manifest), manifest
    try:
        if url is not None:  # every shard through the node cache, then its cached copy
            from .storage.mirror import mirror_corpus

            local, failures = mirror_corpus(url)
            if failures:
                raise FormatError(sorted(failures.values())[0])
        rep = inspect_corpus(
            local,
            splits=split or None,
            seq_len=seq_len,
            batch_size=batch_size,
            packing_buffer=packing_buffer,
            mode=mode,
            seed=seed,
            progress=sys.stderr.isatty() and not as_json,
        )
    except (FormatError, ValueError, ImportError) as e:  # ImportError: a URL's missing backend
        raise fail(str(e), EXIT_BAD_DATA) from None
    except OSError as e:
        raise os_failure("inspect", e) from None
    data = json.dumps(rep.to_json(), indent=2, sort_keys=True)
    _write_inspection(rep, data, output, plot)
    typer.echo(data if as_json else format_inspection(rep))
    raise typer.Exit(EXIT_OK if rep.ok else EXIT_BAD_DATA)


# The options of `h5corpus build`, in --help order: (parameter, type, typer parameter). build_cli
# takes them as keyword arguments (its signature is made from this table, which typer reads).
BUILD_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    (
        "sources",
        list[str] | None,
        typer.Argument(
            None,
            help="Files (.jsonl[.gz|.zst], .parquet, .txt), folders, globs, hf://datasets/ORG/NAME@REV/PATH, "
            "datasets save_to_disk folders, or 'stdlib' (the default: the Python standard library's sources, offline).",
        ),
    ),
    (
        "tokenizer",
        str | None,
        typer.Option(
            None,
            "--tokenizer",
            "-t",
            help="gpt2 (openai-community/gpt2 at a pinned revision, from the HF cache), "
            "bytes (offline byte-level), or a path to tokenizer.json. Default: gpt2; bytes when the only source is stdlib.",
        ),
    ),
    (
        "eos_token",
        str | None,
        typer.Option(
            None,
            "--eos-token",
            help="End-of-document token text, e.g. [SEP] for a BERT WordPiece tokenizer "
            "(default: the first of <|endoftext|>, </s>, <|end_of_text|>, <eos> the tokenizer has).",
        ),
    ),
    (
        "workers",
        int | None,
        typer.Option(None, "--workers", "-w", help="Worker processes (default: all cores); never changes the output."),
    ),
    ("shards_dir", Path, typer.Option(Path("shards"), "--shards-dir", help="Where shards go (shards/<split>/...).")),
    ("manifest", Path, typer.Option(DEFAULT_MANIFEST, "--manifest", help="Manifest to write.")),
    ("split_seed", int, typer.Option(20261003, "--split-seed", help="Seed of the hash split.")),
    (
        "validation_fraction",
        float,
        typer.Option(0.05, "--validation-fraction", help="Probability a document goes to validation."),
    ),
    (
        "max_tokens",
        str | None,
        typer.Option(
            None,
            "--max-tokens",
            help="Token budgets, e.g. train=8M,validation=100k (whole documents in input order; the last one kept whole).",
        ),
    ),
    (
        "max_document_tokens",
        int | None,
        typer.Option(
            None, "--max-document-tokens", help="Cut longer documents to N tokens at write time (flagged, no EOS)."
        ),
    ),
    (
        "on_error",
        str,
        typer.Option(
            "fail", "--on-error", help="fail: stop at a bad record naming file:line; skip: count and list it."
        ),
    ),
    (
        "text_field",
        str,
        typer.Option("text", "--text-field", help="JSON field / parquet, CSV or datasets column holding the text."),
    ),
    (
        "shard_tokens",
        int | None,
        typer.Option(None, "--shard-tokens", help="Most tokens per shard file (default 2**27)."),
    ),
    ("validate", bool, typer.Option(False, "--validate", help="Validate the corpus at the end (exit 1 if it fails).")),
    ("as_json", bool, typer.Option(False, "--json", help="Print the report as JSON.")),
    (
        "overwrite",
        bool,
        typer.Option(False, "--overwrite", help="Delete the manifest, shards and interrupted state first."),
    ),
    (
        "clean",
        bool,
        typer.Option(
            False,
            "--clean",
            help="Filters: documents that are HTML -> their main text (trafilatura); plain text unchanged.",
        ),
    ),
    (
        "fix_unicode",
        bool,
        typer.Option(
            False, "--fix-unicode", help="Filters: repair mojibake, strip control characters (ftfy, conservative)."
        ),
    ),
    (
        "normalize_whitespace",
        bool,
        typer.Option(
            False, "--normalize-whitespace", help="Filters: unify line breaks, collapse spaces, at most one blank line."
        ),
    ),
    (
        "quality_filter",
        bool,
        typer.Option(
            False,
            "--quality-filter",
            help="Filters: drop documents failing the heuristic quality rules (docs/FILTERS.md).",
        ),
    ),
    (
        "lang",
        str | None,
        typer.Option(
            None,
            "--lang",
            help="Filters: keep documents whose detected language is one of these ISO 639-1 codes, e.g. en,de (py3langid).",
        ),
    ),
    (
        "lang_threshold",
        float | None,
        typer.Option(
            None,
            "--lang-threshold",
            help="Filters: smallest language probability kept, in [0, 1] (default 0.5; needs --lang).",
        ),
    ),
    (
        "scrub_pii",
        bool,
        typer.Option(
            False,
            "--scrub-pii",
            help="Filters: replace e-mails, phone numbers, IP addresses with <EMAIL>/<PHONE>/<IP>.",
        ),
    ),
    (
        "near_dedup",
        bool,
        typer.Option(
            False,
            "--near-dedup",
            help="Filters: drop near duplicates (MinHash LSH, 5-word shingles, 128 permutations); the first in input order stays.",
        ),
    ),
    (
        "near_dedup_threshold",
        float | None,
        typer.Option(
            None,
            "--near-dedup-threshold",
            help="Jaccard similarity from which documents are near duplicates, in (0, 1) (default 0.8; implies --near-dedup).",
        ),
    ),
    (
        "perplexity_model",
        Path | None,
        typer.Option(
            None,
            "--perplexity-model",
            help="Filters: score every document by perplexity under this n-gram model (h5corpus quality-model train).",
        ),
    ),
    (
        "max_perplexity",
        float | None,
        typer.Option(
            None,
            "--max-perplexity",
            help="Filters: drop documents whose perplexity is above X (needs --perplexity-model).",
        ),
    ),
    (
        "perplexity_max_chars",
        int | None,
        typer.Option(
            None,
            "--perplexity-max-chars",
            help="Score only the first N characters of each document (cheaper; needs --perplexity-model).",
        ),
    ),
    (
        "drop_worst_fraction",
        float | None,
        typer.Option(
            None,
            "--drop-worst-fraction",
            help="Drop this fraction, in [0, 1), of the documents left after the filters and dedup: the highest "
            "perplexities (needs --perplexity-model; reads every task before deciding).",
        ),
    ),
    (
        "perplexity_scores",
        Path | None,
        typer.Option(
            None,
            "--perplexity-scores",
            help="Write each scored document's id, split, perplexity and whether it was stored (TSV, input order).",
        ),
    ),
    (
        "explain_drops",
        Path | None,
        typer.Option(
            None,
            "--explain-drops",
            help="Write one JSON line per document read but not stored (id, source, line/row, reason), in input order.",
        ),
    ),
    (
        "loss_on",
        str | None,
        typer.Option(
            None,
            "--loss-on",
            help="A fine-tuning build: records are chat (messages), prompt/completion or text (+no_loss_ranges) "
            "objects, and the shards store what is trained on: assistant (every answer), completion (the last), all.",
        ),
    ),
    (
        "chat_template",
        Path | None,
        typer.Option(
            None,
            "--chat-template",
            help="Fine-tuning: tokenizer_config.json with the chat template (default: the one beside the tokenizer).",
        ),
    ),
    (
        "bos",
        str | None,
        typer.Option(
            None, "--bos", help="Fine-tuning: prepend a BOS to every document: 'tokenizer' (its bos_token) or an id."
        ),
    ),
    (
        "task_bytes",
        int | None,
        typer.Option(None, "--task-bytes", help="Input bytes per task, the unit of parallel work (default 16 MiB)."),
    ),
    (
        "max_record_bytes",
        str,
        typer.Option(
            "64M",
            "--max-record-bytes",
            help="Longest record read (a JSON line, a parquet cell, a .txt file), in bytes; K, M, G are powers "
            "of 1024. A longer one is a bad record (stops the build, or counted under --on-error skip).",
        ),
    ),
    (
        "executor",
        str,
        typer.Option(
            "local", "--executor", help="Where the stages run: local (process pool), ray or slurm (docs/SCALING.md)."
        ),
    ),
    (
        "decide_buckets",
        int | None,
        typer.Option(
            None,
            "--decide-buckets",
            help="Buckets of the decide stage (0: in memory; default: in memory on local, 1 per GiB of input otherwise).",
        ),
    ),
    (
        "ray_address",
        str | None,
        typer.Option(
            None, "--ray-address", help="Ray: auto or HOST:PORT of the cluster (default $RAY_ADDRESS, else auto)."
        ),
    ),
    (
        "ray_cpus_per_task",
        float | None,
        typer.Option(None, "--ray-cpus-per-task", help="Ray: CPUs per stage task (1)."),
    ),
    ("partition", str | None, typer.Option(None, "--partition", help="Slurm: partition of every job.")),
    ("time_limit", str | None, typer.Option(None, "--time", help="Slurm: time limit of every job, e.g. 2:00:00.")),
    ("cpus_per_task", int | None, typer.Option(None, "--cpus-per-task", help="Slurm: CPUs per array element (1).")),
    (
        "max_array_size",
        int | None,
        typer.Option(
            None, "--max-array-size", help="Slurm: most elements per job array, the cluster's MaxArraySize (1000)."
        ),
    ),
    (
        "sbatch_arg",
        list[str] | None,
        typer.Option(
            None,
            "--sbatch-arg",
            help="Slurm: extra sbatch argument for every job (repeatable), e.g. --sbatch-arg=--mem=8G.",
        ),
    ),
    (
        "dry_run",
        bool,
        typer.Option(False, "--dry-run", help="Slurm: write the plan and scripts, print them, submit nothing."),
    ),
    ("wait", bool, typer.Option(False, "--wait", help="Slurm: follow the jobs until the manifest is written.")),
)


@app.command("build", cls=FlagHelpCommand)
def build_cli(**flags: Any) -> None:
    """Tokenize SOURCEs into shards/<split>/*.h5 and a manifest: parallel, deterministic, resumable
    (re-run the same command after a crash). Filter stages are off unless a filter flag is given.
    Exit 1 when the build could not be completed (bad input, a full disk, read-only output; what it
    completed is kept), 2 on usage errors.

    CREATES: the shard files, the manifest, --explain-drops FILE and --perplexity-scores FILE when given,
    and while running the run markers shards/.build.lock and .<manifest>.lock beside the manifest and
    shards/.build/.
    """
    raise typer.Exit(build_command(flags))


build_cli.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d, annotation=a)
        for n, a, d in BUILD_OPTIONS
    ]
)


def build_command(f: dict[str, Any]) -> int:
    """``h5corpus build`` with its flags ``f``: check them, build, print; the exit code."""
    srcs = list(f["sources"] or ["stdlib"])
    _check_build_flags(f, srcs)
    executor_cfg = _executor_options(
        f["executor"],
        **{k: f[k] for k in ("ray_address", "ray_cpus_per_task", "partition", "time_limit", "cpus_per_task")},
        **{k: f[k] for k in ("max_array_size", "sbatch_arg", "dry_run", "wait")},
    )
    try:
        filters = _build_filters(
            **{k: f[k] for k in ("clean", "fix_unicode", "normalize_whitespace", "lang", "lang_threshold")},
            **{k: f[k] for k in ("scrub_pii", "near_dedup", "near_dedup_threshold", "perplexity_model")},
            **{k: f[k] for k in ("max_perplexity", "perplexity_max_chars")},
            quality=f["quality_filter"],
        )
    except (ValueError, ImportError) as e:
        raise fail(str(e), EXIT_USAGE) from None
    tokenizer = f["tokenizer"] or ("bytes" if all(s == "stdlib" for s in srcs) else "gpt2")
    report = _run_build(lambda: _build_config(f, srcs, tokenizer, filters, executor_cfg))
    return _print_build(report, f)


def _check_build_flags(f: dict[str, Any], srcs: list[str]) -> None:
    for i, src in enumerate(srcs):
        if not _URL.match(src):  # hf:// specs are checked (and named whole) by the sources
            check_path_arg(f"SOURCE {i + 1}", Path(src))
    for name in ("shards_dir", "manifest", "explain_drops", "chat_template"):
        check_path_arg("--" + name.replace("_", "-"), f[name])
    if f["tokenizer"] is not None:
        check_path_arg("--tokenizer", Path(f["tokenizer"]))
    for name in ("workers", "shard_tokens", "max_document_tokens", "task_bytes"):
        check_positive("--" + name.replace("_", "-"), f[name])


def _build_config(f: dict[str, Any], srcs: list[str], tokenizer: str, filters: Any, executor_cfg: dict) -> BuildConfig:
    """The BuildConfig of the flags (raises ValueError for a bad value)."""
    cfg = BuildConfig(
        sources=srcs,
        tokenizer=tokenizer,
        max_tokens=parse_max_tokens(f["max_tokens"]) if f["max_tokens"] else None,
        progress=sys.stderr.isatty() and not f["as_json"],
        filters=filters,
        **{k: f[k] for k in ("shards_dir", "manifest", "workers", "text_field", "split_seed", "validation_fraction")},
        **{k: f[k] for k in ("max_document_tokens", "on_error", "overwrite", "explain_drops", "decide_buckets")},
        **{k: f[k] for k in ("drop_worst_fraction", "perplexity_scores", "eos_token")},
        **{k: f[k] for k in ("loss_on", "chat_template", "bos")},
        max_record_bytes=parse_byte_size("--max-record-bytes", f["max_record_bytes"]),
        **executor_cfg,
    )
    if f["shard_tokens"] is not None:
        cfg.shard_tokens = f["shard_tokens"]
    if f["task_bytes"] is not None:
        cfg.task_bytes = f["task_bytes"]
    return cfg


def _run_build(make_config: Callable[[], BuildConfig]) -> BuildReport:
    """Build; every library error as one line and its exit code."""
    try:
        return build_corpus(make_config())
    except BuildError as e:
        raise fail(
            f"{e}\n(completed work is kept: fix the input and re-run the same command to resume)", EXIT_BAD_DATA
        ) from None
    except BuildOSError as e:
        raise fail(f"{e}; {e.hint}", EXIT_BAD_DATA) from None
    except FormatError as e:
        raise fail(str(e), EXIT_BAD_DATA) from None
    except (BuildConflict, TokenizerError, SourceError, ValueError) as e:
        raise fail(str(e), EXIT_USAGE) from None
    except OSError as e:
        raise os_failure("build", e) from None
    except KeyboardInterrupt:
        raise fail("interrupted; re-run the same command to resume", 130) from None


def _print_build(report: BuildReport, f: dict[str, Any]) -> int:
    """Print the build's report (and validate with --validate); the exit code."""
    as_json = f["as_json"]
    out = report.to_json()
    if report.submitted:
        typer.echo(json.dumps(out, indent=2, sort_keys=True) if as_json else _format_submission(report))
        return EXIT_OK
    if not as_json:
        typer.echo(format_report(report))
    code = EXIT_OK
    if f["validate"]:
        vr = validate_corpus(f["manifest"], workers=f["workers"], progress=sys.stderr.isatty() and not as_json)
        if as_json:
            out["validation"] = vr.to_json()
            code = EXIT_OK if vr.ok else EXIT_BAD_DATA
        else:
            code = print_validation(vr, False)
    if as_json:
        typer.echo(json.dumps(out, indent=2, sort_keys=True))
    return code


def _executor_options(executor: str, **o) -> dict:
    """The build's ``executor``/``ray``/``slurm`` settings from the flags; an engine's flag without its
    ``--executor`` is a usage error (exit 2)."""

    if executor not in EXECUTORS:
        raise fail(f"--executor must be one of {', '.join(EXECUTORS)}, got {executor!r}", EXIT_USAGE)
    ray_flags = {"--ray-address": o["ray_address"], "--ray-cpus-per-task": o["ray_cpus_per_task"]}
    slurm_flags = {
        "--partition": o["partition"],
        "--time": o["time_limit"],
        "--cpus-per-task": o["cpus_per_task"],
        "--max-array-size": o["max_array_size"],
        "--sbatch-arg": o["sbatch_arg"] or None,
        "--dry-run": o["dry_run"] or None,
        "--wait": o["wait"] or None,
    }
    for engine, flags in (("ray", ray_flags), ("slurm", slurm_flags)):
        given = [k for k, v in flags.items() if v is not None]
        if given and executor != engine:
            raise fail(f"{', '.join(given)} need --executor {engine}", EXIT_USAGE)
    check_positive("--cpus-per-task", o["cpus_per_task"])
    check_positive("--max-array-size", o["max_array_size"])
    if o["ray_cpus_per_task"] is not None and o["ray_cpus_per_task"] <= 0:
        raise fail(f"--ray-cpus-per-task must be > 0, got {o['ray_cpus_per_task']}", EXIT_USAGE)
    ray = RayOptions(address=o["ray_address"])
    if o["ray_cpus_per_task"] is not None:
        ray.cpus_per_task = o["ray_cpus_per_task"]
    slurm = SlurmOptions(
        partition=o["partition"],
        time=o["time_limit"],
        sbatch_args=tuple(o["sbatch_arg"] or ()),
        dry_run=o["dry_run"],
        wait=o["wait"],
    )
    if o["cpus_per_task"] is not None:
        slurm.cpus_per_task = o["cpus_per_task"]
    if o["max_array_size"] is not None:
        slurm.max_array_size = o["max_array_size"]
    return {"executor": executor, "ray": ray, "slurm": slurm}


def _format_submission(report) -> str:
    """What a Slurm build without --wait prints: the job ids, or (dry run) the scripts and commands."""
    s = report.slurm
    if not report.jobs:
        lines = [f"dry run: nothing submitted; plan and scripts are in {Path(report.shards_dir) / '.build'}"]
        for stage, path in s.get("scripts", {}).items():
            lines += [f"--- {path} ({stage})", Path(path).read_text().rstrip()]
        lines.append("--- submit with (each job after the previous ones; $X_JOBS: their ids, colon-separated):")
        lines += s.get("commands", [])
        return "\n".join(lines)
    jobs = ", ".join(f"{stage} {' '.join(ids)}" for stage, ids in report.jobs.items())
    every = ",".join(j for ids in report.jobs.values() for j in ids)
    return (
        f"submitted Slurm jobs: {jobs}\n"
        f"  follow: squeue -j {every}   logs: {s.get('logs')}\n"
        f"  the manifest {report.manifest} is written by the commit job; re-run the same command to resubmit "
        "what is missing after a failure"
    )


@app.command("build-stage")
def build_stage_cli(
    stage: str = typer.Argument(..., help="read, bucket, decide, finish, commit, or status."),
    state: Path = typer.Option(..., "--state", help="The build's state folder (<shards-dir>/.build)."),
    task_index: int | None = typer.Option(
        None, "--task-index", help="read / finish: the task; bucket: the decide bucket (0-based)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the stage's record as JSON."),
) -> None:
    """Run one stage of a planned build from its state folder: what the Slurm jobs run, for any
    scheduler (docs/SCALING.md). A stage whose record is already valid does nothing. Plan a build
    with `h5corpus build ... --executor slurm --dry-run`. Exit 1 on bad input, 2 on usage errors
    (missing plan, stage not ready, index out of range).

    CREATES: the stage's files in the state folder; finish: the task's shards; commit: the manifest
    (then the state folder is removed).
    """

    check_path_arg("--state", state)
    try:
        if stage == "status":
            out = stage_status(state)
        else:
            rec = main_stage(stage, state, task_index)
            out = rec.to_json() if hasattr(rec, "to_json") else rec
    except (BuildError, FormatError) as e:
        raise fail(str(e), EXIT_BAD_DATA) from None
    except (BuildConflict, ValueError) as e:
        raise fail(str(e), EXIT_USAGE) from None
    if as_json or stage == "status":
        typer.echo(json.dumps(out, indent=2, sort_keys=True, default=str))
    else:
        where = "" if task_index is None else f" {task_index}"
        typer.echo(
            f"build-stage {stage}{where}: done" + ("" if out is not None else " (past the budgets: nothing to do)")
        )
    raise typer.Exit(EXIT_OK)


def _build_filters(
    *,
    clean: bool,
    fix_unicode: bool,
    normalize_whitespace: bool,
    quality: bool,
    lang: str | None,
    lang_threshold: float | None,
    scrub_pii: bool,
    near_dedup: bool,
    near_dedup_threshold: float | None,
    perplexity_model: Path | None = None,
    max_perplexity: float | None = None,
    perplexity_max_chars: int | None = None,
):
    """The build's filter flags -> a DocumentFilter, or None when every stage is off (the build is
    then exactly the filter-free one). Raises ValueError for bad values (exit 2)."""

    codes = parse_lang_codes(lang) if lang is not None else ()
    if lang is not None and not codes:
        raise ValueError("--lang: give ISO 639-1 codes, e.g. --lang en,de")
    if lang_threshold is not None and not codes:
        raise ValueError("--lang-threshold needs --lang")
    for flag, value in (("--max-perplexity", max_perplexity), ("--perplexity-max-chars", perplexity_max_chars)):
        if value is not None and perplexity_model is None:
            raise ValueError(f"{flag} needs --perplexity-model")
    cfg = FilterConfig(
        clean=clean,
        fix_unicode=fix_unicode,
        normalize_whitespace=normalize_whitespace,
        quality=quality,
        lang=codes,
        scrub_pii=scrub_pii,
        near_dedup=near_dedup or near_dedup_threshold is not None,
        perplexity_model=None if perplexity_model is None else str(perplexity_model),
        max_perplexity=max_perplexity,
        perplexity_max_chars=perplexity_max_chars,
    )
    if lang_threshold is not None:
        cfg.lang_threshold = lang_threshold
    if near_dedup_threshold is not None:
        cfg.near_dedup_threshold = near_dedup_threshold
    if not cfg.enabled:
        return None
    return DocumentFilter(cfg)  # validates (ValueError naming the field)


quality_app = typer.Typer(
    name="quality-model",
    help="N-gram language models for the perplexity filter: train on reference text, score documents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(quality_app, name="quality-model")


@quality_app.command("train")
def quality_train_cli(
    reference: list[str] = typer.Argument(
        ..., help="Reference documents: build SOURCEs (files, folders, globs, hf://..., stdlib)."
    ),
    output: Path = typer.Option(..., "--output", "-o", help="Model file to write (.npz)."),
    order: int = typer.Option(3, "--order", help="N-gram order, 1-6 (2: bigrams, as the seed lesson; 3: default)."),
    text_field: str = typer.Option("text", "--text-field", help="JSON field / parquet column holding the text."),
    max_documents: int | None = typer.Option(None, "--max-documents", help="Train on the first N documents only."),
    as_json: bool = typer.Option(False, "--json", help="Print the model's header as JSON."),
) -> None:
    """Train an interpolated modified Kneser-Ney n-gram model on REFERENCE documents (docs/FILTERS.md).
    Exit 1 on a bad record or no text, 2 on usage errors.

    CREATES: the model file (written to a temporary name, then renamed).
    """

    check_path_arg("--output", output)
    check_positive("--max-documents", max_documents)
    if not 1 <= order <= MAX_ORDER:
        raise fail(f"--order must be in 1..{MAX_ORDER}, got {order}", EXIT_USAGE)
    try:
        rep = train_from_sources(
            reference,
            output,
            order=order,
            text_field=text_field,
            max_documents=max_documents,
            progress=sys.stderr.isatty() and not as_json,
        )
    except SourceError as e:
        raise fail(str(e), EXIT_USAGE) from None
    except (BadReference, ValueError) as e:
        raise fail(str(e), EXIT_BAD_DATA) from None
    if as_json:
        typer.echo(json.dumps(rep.to_json(), indent=2, sort_keys=True))
    else:
        h, t = rep.header, rep.header["training"]
        typer.echo(
            f"trained order-{h['order']} model on {t['documents']:,} documents ({t['characters']:,} characters, "
            f"{t['units']:,} units): n-grams {' / '.join(f'{n:,}' for n in h['ngrams'])}, vocabulary "
            f"{h['smoothing']['vocabulary']:,}\nwrote {rep.path} ({rep.file_bytes:,} bytes, sha256 {h['sha256']})"
        )
    raise typer.Exit(EXIT_OK)


@quality_app.command("score")
def quality_score_cli(
    model: Path = typer.Argument(..., help="Model file (quality-model train)."),
    sources: list[str] = typer.Argument(..., help="Documents to score: build SOURCEs."),
    text_field: str = typer.Option("text", "--text-field", help="JSON field / parquet column holding the text."),
    max_documents: int | None = typer.Option(None, "--max-documents", help="Score the first N documents only."),
    max_chars: int | None = typer.Option(None, "--max-chars", help="Score the first N characters of each document."),
    summary_only: bool = typer.Option(False, "--summary-only", help="Print only the count and quantiles."),
    as_json: bool = typer.Option(False, "--json", help="Print the scores and quantiles as JSON."),
) -> None:
    """Print each document's perplexity (where, perplexity, units, start of the text; tab-separated)
    and the quantiles (p80 is the --max-perplexity that drops the worst 20%). Exit 1 on a bad
    record, 2 on usage errors and on a model file that is missing, corrupt or refused."""

    check_path_arg("MODEL", model)
    check_positive("--max-documents", max_documents)
    check_positive("--max-chars", max_chars)
    if not model.is_file():
        raise fail(f"{model}: model file not found", EXIT_USAGE)
    try:
        rep = score_sources(
            model,
            sources,
            text_field=text_field,
            max_documents=max_documents,
            max_chars=max_chars,
            progress=sys.stderr.isatty() and not as_json,
        )
    except (SourceError, ModelFileError) as e:
        raise fail(str(e), EXIT_USAGE) from None
    except BadReference as e:
        raise fail(str(e), EXIT_BAD_DATA) from None
    if as_json:
        typer.echo(json.dumps(rep.to_json(documents=not summary_only), indent=2, sort_keys=True))
        raise typer.Exit(EXIT_OK)
    if not summary_only:
        for w, p, u, t in zip(rep.where, rep.perplexity, rep.units, rep.preview):
            typer.echo(f"{w}\t{p:.2f}\t{u}\t{t}")
    q = " ".join(f"{k}={v:,.1f}" for k, v in rep.quantiles().items())
    typer.echo(f"scored {len(rep.perplexity):,} documents with {model} (sha256 {rep.model_sha256[:16]}): {q}")
    raise typer.Exit(EXIT_OK)


@app.command("plan")
def plan_cli(
    manifest: Path = typer.Argument(DEFAULT_MANIFEST, help="Path to shards.json."),
    plan_dir: Path = typer.Option(..., "--plan-dir", help="Folder of plan files (BestFitDataset(plan_dir=...))."),
    split: str = typer.Option("train", "--split"),
    epochs: int = typer.Option(1, "--epochs", help="Epochs to plan, from --first-epoch on."),
    first_epoch: int = typer.Option(0, "--first-epoch"),
    max_seq_len: int = typer.Option(4096, "--max-seq-len", help="Pack capacity, in tokens."),
    batch_size: int = typer.Option(35, "--batch-size", help="Packs per microbatch."),
    packing_buffer: int | None = typer.Option(None, "--packing-buffer", help="Chunks (default 64 / 16,384 by mode)."),
    seed: int = typer.Option(0, "--seed"),
    mode: str = typer.Option("buffer", "--mode", help="buffer or bfd."),
    shuffle: bool = typer.Option(True, "--shuffle/--no-shuffle"),
    shuffle_block_shards: int | None = typer.Option(
        None,
        "--shuffle-block-shards",
        help="Shuffle chunks within blocks of this many shards (default: the rolling window).",
    ),
    shuffle_window_shards: int | None = typer.Option(
        None,
        "--shuffle-window-shards",
        help="The chunk order's rolling window, in shards (default 64); 0: shuffle over the whole split.",
    ),
    workers: int = typer.Option(1, "--workers", "-w", help="Epochs planned at once."),
    rebuild: bool = typer.Option(False, "--rebuild", help="Rewrite plan files that already exist."),
) -> None:
    """Precompute the best-fit loader's epoch plans into --plan-dir (one file per epoch)."""
    from .loaders.bestfit import write_plans  # loaders and torch: only for the commands that read batches

    check_path_arg("MANIFEST", manifest)
    check_local_manifest(manifest)
    if not manifest.exists():
        raise fail(f"{manifest}: manifest not found", EXIT_USAGE)
    check_positive("--epochs", epochs)
    settings = dict(max_seq_len=max_seq_len, batch_size=batch_size, packing_buffer=packing_buffer, seed=seed)
    if shuffle_block_shards is not None:
        settings["shuffle_block_shards"] = shuffle_block_shards
    if shuffle_window_shards is not None:
        settings["shuffle_window_shards"] = shuffle_window_shards or None
    try:
        paths = write_plans(
            manifest, plan_dir, range(first_epoch, first_epoch + max(epochs, 0)), workers=workers, rebuild=rebuild,
            split=split, mode=mode, shuffle=shuffle, **settings,
        )  # fmt: skip
    except FormatError as e:  # the corpus is bad, not the command line
        raise fail(f"plan: {e}", EXIT_BAD_DATA) from None
    except (ValueError, TypeError) as e:
        raise fail(f"plan: {e}", EXIT_USAGE) from None
    except OSError as e:
        raise os_failure(f"plan {plan_dir}", e) from None
    for p in paths:
        typer.echo(p)


@app.command("upload")
def upload_cli(
    manifest: Path = typer.Argument(..., help="Manifest (shards.json) of a finished local corpus."),
    dest: str = typer.Argument(..., help="Object-storage URL of the corpus folder, e.g. s3://bucket/corpus."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds before a stalled request fails."),
    retries: int = typer.Option(3, "--retries", help="Attempts per transfer after the first (with back-off)."),
) -> None:
    """Publish a corpus to object storage: every shard checked, then uploaded, the manifest last (a
    reader never sees a manifest whose shards are missing). Rerun after a failure: it resumes."""
    from .storage.publish import upload_corpus
    from .storage.remote import RemoteOptions

    check_path_arg("MANIFEST", manifest)
    check_local_manifest(manifest)
    if not manifest.is_file():
        raise fail(f"{manifest}: manifest not found", EXIT_USAGE)
    try:
        opts = RemoteOptions(timeout_s=timeout, retries=retries)
        rep = upload_corpus(manifest, dest, options=opts, progress=None if as_json else typer.echo)
    except FormatError as e:  # a refused request, a time-out, a shard that is not what its entry says
        raise fail(f"upload: {e}", EXIT_BAD_DATA) from None
    except (ValueError, ImportError) as e:
        raise fail(f"upload: {e}", EXIT_USAGE) from None
    except OSError as e:
        raise os_failure(f"upload {manifest}", e) from None
    if as_json:
        typer.echo(json.dumps(rep.to_json(), indent=2, sort_keys=True))
    else:
        typer.echo(
            f"uploaded {rep.uploaded} shards ({rep.bytes_uploaded:,} bytes), {rep.skipped} already there; manifest: {rep.to_json()['manifest_url']}"
        )


def main() -> None:
    app()


if __name__ == "__main__":
    main()
