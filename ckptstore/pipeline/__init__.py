"""Moving bytes: the save pipeline (stage -> hash -> compress -> write -> commit) and the
restore pipeline (fetch -> verify -> decompress -> place), under a memory budget.

    options.py     SaveOptions, Staging, SaveInfo, LoadOptions: every knob, checked once
    commit.py      SaveRequest (what a save commits) and the Committer seam
    writer.py      the save: chunk and pack jobs, the commit
    overlap.py     overlapped staging: the pool, version checks, optimizer guards
    staging.py     the arena of copy-staged async saves
    writer_process.py  the writer process of overlapped saves into a local folder
    reader.py      the restore: ranged reads, verification, fallbacks
    loading.py     restore a manifest into new objects or into existing tensors

Depends on `format` and `stores`; knows nothing of repositories, leases or training."""
