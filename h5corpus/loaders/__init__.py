"""Training-side reading: padding-free ``VarlenBatch``es from a stored corpus (sliding windows or
best-fit packed documents), partitioned over DDP ranks and DataLoader workers, plus the varlen
attention and loss helpers. Imports only :mod:`h5corpus.storage` (and torch).

Modules: ``batch`` (the batch type), ``window`` (sliding windows), ``chunking`` -> ``packers`` ->
``plan`` -> ``bestfit`` (best-fit packing: long documents cut into chunks, pure packers over
lengths, the epoch plan, the dataset that reads it), ``partition`` (which consumer a process is),
``attention`` (varlen attention and the loss). See ``docs/READING.md`` and ``docs/PACKING.md``.
"""
