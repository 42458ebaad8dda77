"""Helpers of bench/dist_bench.py: multi-rank save/restore, ckptstore against DCP."""
