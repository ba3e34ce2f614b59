"""Source-tree lint (docs/security.md, 'Deserialization'): no pickle, unguarded torch.load, unsafe YAML or eval.

Peer bytes are decoded only as protobuf, msgpack or raw tensor bytes. This test parses every
.py file of the product packages (generated *_pb2*.py and tests/ are skipped) and fails with
``file:line: what`` for each of:

* ``pickle.load(`` / ``pickle.loads(`` (also ``cPickle``/``_pickle``/``dill``, aliases and
  ``from pickle import loads``);
* ``torch.load(`` without ``weights_only=True``;
* ``yaml.load(`` without ``Loader=SafeLoader``/``CSafeLoader``, and ``yaml.unsafe_load(``;
* bare ``eval(``.

Fix by decoding with msgpack/protobuf, passing ``weights_only=True``, using ``yaml.safe_load``,
or parsing the value explicitly (``ast.literal_eval``, ``int()``...).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("node", "protocol", "optimizers", "pipeline", "rl", "security", "models", "benchmarks")
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader"}


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


class _Scanner(ast.NodeVisitor):
    def __init__(self):
        self.aliases: dict[str, str] = {}  # local name -> canonical dotted name
        self.findings: list[tuple[int, str]] = []

    def visit_Import(self, node: ast.Import):
        for a in node.names:
            self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]

    def visit_ImportFrom(self, node: ast.ImportFrom):
        for a in node.names:
            if node.module:
                self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def _canonical(self, func: ast.AST) -> str | None:
        name = _dotted(func)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        head = self.aliases.get(head, head)
        return f"{head}.{rest}" if rest else head

    def visit_Call(self, node: ast.Call):
        name = self._canonical(node.func) or ""
        module, _, attr = name.rpartition(".")
        kwargs = {k.arg: k.value for k in node.keywords if k.arg}
        if module.split(".")[0] in PICKLE_MODULES and attr in ("load", "loads", "Unpickler"):
            self.findings.append((node.lineno, f"{name}( — unpickling runs arbitrary code; use msgpack/protobuf"))
        elif name == "torch.load" and not _is_true(kwargs.get("weights_only")):
            self.findings.append((node.lineno, "torch.load( without weights_only=True"))
        elif name == "yaml.unsafe_load":
            self.findings.append((node.lineno, "yaml.unsafe_load( — use yaml.safe_load"))
        elif name == "yaml.load":
            loader = kwargs.get("Loader", node.args[1] if len(node.args) > 1 else None)
            loader_name = (_dotted(loader) or "").rpartition(".")[2] if loader is not None else ""
            if loader_name not in SAFE_YAML_LOADERS:
                self.findings.append((node.lineno, "yaml.load( without SafeLoader — use yaml.safe_load"))
        elif isinstance(node.func, ast.Name) and node.func.id == "eval":
            self.findings.append((node.lineno, "eval( — parse the value explicitly (ast.literal_eval, int())"))
        self.generic_visit(node)


_FALLBACK = [  # used only for files that do not parse (someone mid-edit)
    (re.compile(r"\b(c?pickle|_pickle|dill)\.loads?\("), "pickle.load(s)("),
    (re.compile(r"\btorch\.load\((?![^)]*weights_only\s*=\s*True)"), "torch.load( without weights_only=True"),
    (re.compile(r"\byaml\.load\((?![^)]*Loader\s*=\s*(yaml\.)?C?SafeLoader)"), "yaml.load( without SafeLoader"),
    (re.compile(r"(?<![\w.])eval\("), "eval("),
]


def scan_source(text: str, filename: str = "<string>") -> list[str]:
    """``["file:line: problem", ...]`` for one source text."""
    try:
        tree = ast.parse(text, filename=filename)
    except SyntaxError:
        return [f"{filename}:{i}: {what}" for i, line in enumerate(text.splitlines(), 1)
                if not line.lstrip().startswith("#") for rx, what in _FALLBACK if rx.search(line)]
    scanner = _Scanner()
    scanner.visit(tree)
    return [f"{filename}:{line}: {what}" for line, what in sorted(scanner.findings)]


def product_files() -> list[Path]:
    files = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "_pb2" in path.name or "tests" in rel.parts:
                continue
            files.append(path)
    return files


def test_no_unsafe_deserialization_in_source_tree():
    files = product_files()
    assert any(p.parts[-2:] == ("security", "records.py") for p in files), "scanner found no files"
    findings = []
    for path in files:
        findings += scan_source(path.read_text(encoding="utf-8", errors="replace"), str(path.relative_to(ROOT)))
    for line in findings:
        print(line)
    assert not findings, "unsafe deserialization:\n" + "\n".join(findings)


BAD_SNIPPET = """\
import pickle
import pickle as pk
from pickle import loads
import torch, yaml
a = pickle.loads(b"")
b = pk.load(open("f", "rb"))
c = loads(b"")
d = torch.load("ckpt.pt")
e = torch.load("ckpt.pt", weights_only=False)
f = yaml.load(text)
g = yaml.load(text, Loader=yaml.FullLoader)
h = eval("1 + 1")
i = yaml.unsafe_load(text)
"""

GOOD_SNIPPET = """\
import ast, json, msgpack, torch, yaml
a = msgpack.unpackb(b"\\x90", raw=False)
b = torch.load("ckpt.pt", weights_only=True, map_location="cpu")
c = yaml.safe_load(text)
d = yaml.load(text, Loader=yaml.SafeLoader)
e = ast.literal_eval("[1, 2]")
f = model.eval()
g = json.loads("{}")
# pickle.loads(x) in a comment is fine
"""


def test_scanner_flags_synthetic_bad_snippet():
    findings = scan_source(BAD_SNIPPET, "bad.py")
    lines = sorted(int(f.split(":")[1]) for f in findings)
    assert lines == [5, 6, 7, 8, 9, 10, 11, 12, 13], findings
    assert all(f.startswith("bad.py:") for f in findings)


def test_scanner_accepts_safe_code():
    assert scan_source(GOOD_SNIPPET, "good.py") == []


def test_fallback_regex_on_unparsable_file():
    findings = scan_source("def broken(:\n    x = pickle.loads(data)\n    torch.load(p)\n", "broken.py")
    assert [f.split(":")[1] for f in findings] == ["2", "3"], findings
