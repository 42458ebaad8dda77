"""Moving bytes: the save pipeline (stage -> hash -> compress -> write -> commit) and the
restore pipeline (fetch -> verify -> decompress -> place), under a memory budget.

Depends on `format` and `stores`; knows nothing of repositories, leases or training."""
