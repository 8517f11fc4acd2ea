"""benchmarks/bench_frontend_cpu.py's variants: an environment variable or blink serve's arguments."""
import argparse

import pytest

from benchmarks.bench_frontend_cpu import Variant, parse_variant


def test_an_environment_variable():
    assert parse_variant("aligned:BLINK_FRONTEND_POLL_ALIGN=1") == Variant(
        "aligned", {"BLINK_FRONTEND_POLL_ALIGN": "1"}, [])


def test_serve_arguments_split_as_a_shell_would():
    variant = parse_variant("off:--thread-policy off --max-num-seqs '8'")
    assert variant == Variant("off", {}, ["--thread-policy", "off", "--max-num-seqs", "8"])
    assert variant.setting == "--thread-policy off --max-num-seqs 8"


@pytest.mark.parametrize("text", ["no-colon", ":X=1", "a:not an identifier=1", "a:X", "a:-x"])
def test_a_malformed_variant_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="NAME:VAR=VALUE or NAME:--option"):
        parse_variant(text)
