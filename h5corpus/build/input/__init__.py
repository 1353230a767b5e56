"""Input: what a build reads, before any token exists.

Owns the SOURCE specs and their tasks (:mod:`.sources`: files, folders, globs, ``hf://`` files),
the records a task yields (:mod:`.records`: ``.jsonl[.gz|.zst]``, ``.parquet``, ``.txt``, with
file:line locations; :mod:`.zstdframes` for zstd stream ends), and ``datasets`` sources
(:mod:`.hfdatasets` plans their tasks, :mod:`.hfrecords` reads their rows).
"""
