"""Helpers of bench/dataloader_bench.py (each runner is also a standalone script)."""
