"""Argument types shared by the `ckpt` and `ckpt-data` command lines."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An argparse `type`: a positive integer, else a one-line usage error naming the text."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)
