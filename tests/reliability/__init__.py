"""Reliability campaigns: kill -9, simulated power loss, S3 faults, corruption, gc races.

See docs/reliability.md for what each campaign proves, its figures and its limits. The quick
profile runs with the unit tests (marker `reliability`); the soak profile is enabled by
`python -m pytest tests/reliability --soak` or `CKPT_SOAK=1`.
"""
