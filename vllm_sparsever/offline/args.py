"""argparse types shared by the commands (an invalid value: argparse names the flag and exits 2)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value
