"""What tool calling costs the frontend: the per-delta time of each tool-call parser (a
choice's text fed one token-sized piece at a time, as a stream is) for plain content and for
a long call, and checking a request's tools (cold and cached JSON-schema check).

    python -m benchmarks.bench_tool_parsers [--chars 40000] [--piece 4] [--repeat 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

from blink.dpu.tool_calling import _schema_problem, validate_tools
from blink.dpu.tool_parsers import TOOL_PARSERS, RequiredToolParser, ToolCallStream


def _per_piece_us(make: Callable[[], ToolCallStream], text: str, piece: int,
                  repeat: int) -> float:
    """Median over ``repeat`` runs of the mean µs one ``step`` takes."""
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)]
    runs = []
    for _ in range(repeat):
        stream = make()
        t0 = time.perf_counter()
        for p in pieces:
            stream.step(p)
        stream.step("", final=True)
        runs.append((time.perf_counter() - t0) / len(pieces) * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, default=40_000, help="length of each text")
    ap.add_argument("--piece", type=int, default=4, help="characters per delta (~1 token)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    prose = ("The weather in Paris is mild today, with a light breeze. " * 1000)[: args.chars]
    arguments = json.dumps({"code": ("x = [1, 2, {'a': \"}\"}]\n" * 2000)[: args.chars]})
    calls = {
        "hermes": f'<tool_call>\n{{"name": "run", "arguments": {arguments}}}\n</tool_call>',
        "llama3_json": f'<|python_tag|>{{"name": "run", "parameters": {arguments}}}',
        "mistral": f'[TOOL_CALLS][{{"name": "run", "arguments": {arguments}}}]',
        "required": f'[{{"name": "run", "parameters": {arguments}}}]',
    }
    parsers = {**TOOL_PARSERS, "required": RequiredToolParser}
    print(f"per delta ({args.piece} characters), median of {args.repeat} runs, µs")
    print(f"{'parser':12} {'content':>9} {'long call':>10}")
    for name, cls in parsers.items():
        content = _per_piece_us(lambda: ToolCallStream(cls()), prose, args.piece, args.repeat)
        call = _per_piece_us(lambda: ToolCallStream(cls()), calls[name], args.piece,
                             args.repeat)
        print(f"{name:12} {content:9.2f} {call:10.2f}")

    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {
        "type": "object", "properties": {f"p{j}": {"type": "string", "maxLength": 30 + i}
                                         for j in range(8)}, "required": ["p0"]}}}
             for i in range(16)]
    _schema_problem.cache_clear()
    t0 = time.perf_counter()
    validate_tools(tools)
    cold = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    for _ in range(100):
        validate_tools(tools)
    warm = (time.perf_counter() - t0) * 10
    print(f"validate 16 tools x 8 parameters: cold {cold:.2f} ms, cached {warm:.3f} ms")


if __name__ == "__main__":
    main()
