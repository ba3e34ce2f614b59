"""Generate Python modules from ``protocol/*.proto`` with grpcio-tools.

    python -c "import protocol"       # regenerate if any .proto is newer (what builds use)
    python -m protocol.build --force  # regenerate all (the import above has already run once)

Generated files import each other as ``protocol.<name>_pb2``, because protoc runs with
the repository root (the parent of this folder) as include path.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _stale(proto: Path) -> bool:
    outs = [proto.with_name(proto.stem + "_pb2.py"), proto.with_name(proto.stem + "_pb2_grpc.py")]
    return any(not o.exists() or o.stat().st_mtime < proto.stat().st_mtime for o in outs)


def ensure_generated(force: bool = False) -> list[str]:
    """Regenerate stale modules; return the names of the .proto files compiled."""
    protos = sorted(HERE.glob("*.proto"))
    todo = [p for p in protos if force or _stale(p)]
    if not todo:
        return []
    try:
        from grpc_tools import protoc
        import grpc_tools
    except ImportError as exc:  # pragma: no cover - dependency is pinned
        raise RuntimeError(
            "protocol/*.proto need generating but grpcio-tools is missing; "
            "install it with `pip install 'grpcio-tools==1.81.*'`") from exc
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    root = HERE.parent
    args = ["protoc", f"-I{root}", f"-I{include}", f"--python_out={root}",
            f"--grpc_python_out={root}", f"--pyi_out={root}"]
    args += [str(p.relative_to(root)) for p in todo]
    try:
        rc = protoc.main(args)
    except PermissionError as exc:
        raise RuntimeError(
            f"cannot write generated protocol modules next to {HERE}; run "
            "`python -m protocol.build` once where the package is writable") from exc
    if rc != 0:
        raise RuntimeError(f"protoc failed (exit {rc}) on {[p.name for p in todo]}")
    return [p.name for p in todo]


if __name__ == "__main__":
    done = ensure_generated(force="--force" in sys.argv)
    print("generated:", ", ".join(done) if done else "nothing (up to date)")
