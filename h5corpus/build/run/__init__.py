"""Running a build: the driver and the executors it runs stages on.

Owns :func:`~.runner.build_corpus` (the driver), the local process pool and the build lock
(:mod:`.executor`), Ray (:mod:`.ray_executor`), the scaled decide forms (:mod:`.scaled`) and
Slurm submission (:mod:`.slurm`).
"""
