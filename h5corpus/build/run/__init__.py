"""Running a build: one preparation, one driver, and where the stages run.

Owns :func:`~.runner.build_corpus` (the entry point: output checks, lock, tasks), :func:`~.prepare.prepare`
(encoder, decider, decide form, plan; shared by every way of running), :func:`~.drive.drive` (the one
event loop, for the local process pool and Ray, deciding in memory or in buckets),
:func:`~.slurm.submit_slurm` (the stages as job arrays), and the executors: the local process pool
and the build lock (:mod:`.executor`) and Ray (:mod:`.ray_executor`).
"""
