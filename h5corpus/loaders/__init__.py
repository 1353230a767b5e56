"""Training-side reading: padding-free ``VarlenBatch``es from a stored corpus (sliding windows or
best-fit packed documents), one global sequence of microbatches per epoch shared by DDP ranks and
DataLoader workers, weighted mixtures of corpora, plus the varlen attention and loss helpers.
Imports only :mod:`h5corpus.storage` (and torch).

Modules: ``batch`` (the batch type), ``window`` (sliding windows), ``chunking`` -> ``packers`` ->
``plan`` -> ``bestfit`` (best-fit packing: long documents cut into chunks, pure packers over
lengths, the epoch's global plan, the dataset that reads it), ``partition`` (which microbatches a
rank and worker yields, the remainder rule), ``sequence`` (what both datasets share: ``len``,
``set_epoch``, ``seek``, checkpoints), ``state`` (the checkpoint format and its validation),
``mixture`` (``mix``: weighted mixtures), ``attention`` (varlen attention and the loss). See
``docs/READING.md`` and ``docs/PACKING.md``.
"""
