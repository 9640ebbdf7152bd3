"""Argument types of the command line: each checks its value at parse time and names
what was expected."""

from __future__ import annotations

import argparse

__all__ = ["MODEL_HELP", "finite_float", "fraction", "generate_modes", "ints", "layer_list",
           "non_negative_int", "positive_int", "prompt", "shapes", "strs", "temperature",
           "top_p", "window"]


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def shapes(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for item in text.split(","):
        k, n = item.lower().split("x")
        out.append((int(k), int(n)))
    return tuple(out)


def strs(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def window(text: str) -> int:
    """A perplexity window: at least 2 tokens (one predicts the next)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2, got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2 (a window scores each "
                                         f"token from the ones before it), got {value}")
    return value


def fraction(text: str) -> float:
    """A fraction strictly between 0 and 1."""
    value = finite_float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number > 0 and < 1, got {value}")
    return value


def temperature(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"temperature must be >= 0 (0 = greedy), got {value}")
    return value


def top_p(text: str) -> float:
    value = finite_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"top-p must be in (0, 1], got {value}")
    return value


def finite_float(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def prompt(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("a prompt must not be empty")
    return text


def generate_modes(text: str) -> tuple[str, ...]:
    modes = strs(text)
    bad = [m for m in modes if m not in ("fixed", "paper")]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown modes {bad or [text]}: expected a "
                                         "comma-separated subset of fixed,paper")
    return modes


def layer_list(text: str) -> list[int]:
    """``0,3,5`` or ``0-9`` or a mix (``0-3,10``); repeats and bad numbers are refused."""
    from structlm.hf.pipeline import check_layers

    out: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                a, b = part.split("-", 1)
                if int(b) < int(a):
                    raise argparse.ArgumentTypeError(f"empty layer range {part!r}")
                out.extend(range(int(a), int(b) + 1))
            elif part:
                out.append(int(part))
        check_layers(out)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad layer list {text!r}: {e}") from None
    return out


MODEL_HELP = "smollm2 or qwen2.5-coder (built in), a local folder, or a hub id"
"""Help of every ``model`` argument that takes a pretrained model."""
