"""Helpers of bench/ckpt_bench.py: synthetic states, contestants, memory meters, report."""
