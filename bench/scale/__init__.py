"""Helpers of bench/scale_bench.py (the scale benchmark of issue 26), one module per part:

    common      subprocess runner (wall time, peak RSS), timing, tracemalloc, cProfile
    states      the synthetic states: small fp32 tensors, MoE with Adam, Llama-shaped layouts
    manifest    part "manifest": manifest size, parse, partial-restore plan, load(keys=[one])
    keys        part "keys": load(keys=[K keys]) against K
    history     parts "incremental" and "ls": a repository of checkpoints saved from restarted
                processes; incremental vs full saves; ckpt ls / du / gc, list() / latest()
    small       part "small": 1 KiB tensors against the raw write/read limit
    many        part "many": a save's cost against the number of checkpoints in the repository
    collective  part "collective": collective saves simulated for many ranks (the planning and
                commit steps on synthesized per-rank inputs)
    report      rich tables, Markdown and the issue's targets (met / missed)
"""
