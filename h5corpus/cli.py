"""``h5corpus`` command line: a thin layer over the library.

Exit codes: 0 success, 1 the data is bad (corruption, a failed check, bad input), 2 usage error
(missing file, bad option).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .manifest import DEFAULT_MANIFEST

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


@app.callback()
def _root() -> None:
    """Tokenize raw text into sharded, verifiable HDF5 corpora; validate and inspect them."""


def fail(message: str, code: int) -> "typer.Exit":
    """Print ``message`` to stderr and return the Exit to raise."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


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
    manifest: Path = typer.Argument(DEFAULT_MANIFEST, help="Path to shards.json."),
    workers: Optional[int] = typer.Option(None, "--workers", "-w", help="Hashing processes (default: all cores)."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable report."),
) -> None:
    """Recompute every shard's sha256 in parallel and check structure. Exit 1 naming each failing shard."""
    from .validate import validate_corpus

    if not manifest.exists():
        raise fail(f"{manifest}: manifest not found", EXIT_USAGE)
    report = validate_corpus(manifest, workers=workers, progress=sys.stderr.isatty() and not as_json)
    raise typer.Exit(print_validation(report, as_json))


@app.command("inspect")
def inspect_cli(
    manifest: Path = typer.Argument(DEFAULT_MANIFEST, help="Path to shards.json."),
    split: Optional[list[str]] = typer.Option(None, "--split", help="Split(s) to inspect (default: all present)."),
    seq_len: int = typer.Option(4096, "--seq-len", help="Independent context limit, in input tokens."),
    batch_size: int = typer.Option(35, "--batch-size", help="Packs per microbatch."),
    packing_buffer: int = typer.Option(64, "--packing-buffer", help="Best-fit candidate buffer, in chunks."),
    mode: str = typer.Option("buffer", "--mode", help="Packing mode: buffer or bfd."),
    seed: int = typer.Option(0, "--seed", help="Sampler seed for the packing simulation and checks."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON instead of the table."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Also write the JSON figures to this file."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG: length histogram, pack fill, tokens per split."),
) -> None:
    """Counts, statistics, pack fill and the seed's data checks. Exit 1 if any check fails.

    CREATES: --output JSON and --plot PNG when given; nothing else.
    """
    from .format import FormatError
    from .inspect import format_report, inspect_corpus, plot_report

    if not manifest.exists():
        raise fail(f"{manifest}: manifest not found", EXIT_USAGE)
    if mode not in ("buffer", "bfd"):
        raise fail(f"--mode must be buffer or bfd, got {mode!r}", EXIT_USAGE)
    try:
        rep = inspect_corpus(manifest, splits=split or None, seq_len=seq_len, batch_size=batch_size,
                             packing_buffer=packing_buffer, mode=mode, seed=seed,
                             progress=sys.stderr.isatty() and not as_json)
    except (FormatError, ValueError) as e:
        raise fail(str(e), EXIT_BAD_DATA)
    data = json.dumps(rep.to_json(), indent=2, sort_keys=True)
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(data + "\n")
    if plot:
        plot_report(rep, plot)
    typer.echo(data if as_json else format_report(rep))
    raise typer.Exit(EXIT_OK if rep.ok else EXIT_BAD_DATA)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
