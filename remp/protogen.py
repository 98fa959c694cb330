"""Generate the Python gRPC code from ``protos/`` (committed, with a drift check).

    python -m remp.protogen            # regenerate into the source tree
    python -m remp.protogen --check    # exit 1 if the committed code differs from a fresh run

The generated modules land under ``remp/<service>/v1/`` (the proto package path), with ``.pyi``
stubs. Never edit them by hand: edit the ``.proto`` and regenerate. ``grpcio-tools`` is pinned in
pyproject.toml so the output is reproducible.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
INIT_TEXT = "# Generated package (remp.protogen). Do not edit.\n"


def generate(out_root: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Run protoc into ``out_root``; return the generated files relative to it."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(proto_dir)) for p in sorted(proto_dir.rglob("*.proto"))]
    args = [
        "protoc",
        f"-I{proto_dir}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    out: list[Path] = []
    for rel in files:  # remp/<service>/v1/x.proto -> packages remp/<service>, remp/<service>/v1
        v1_dir = Path(rel).parent
        for pkg in (v1_dir, v1_dir.parent):
            (out_root / pkg / "__init__.py").write_text(INIT_TEXT)
    for p in sorted(out_root.rglob("*")):
        if p.is_file() and (p.name.endswith(GENERATED_SUFFIXES) or p.read_text() == INIT_TEXT):
            out.append(p.relative_to(out_root))
    return out


def stale_files(root: Path = ROOT) -> tuple[list[Path], Path]:
    """Generate from ``root/protos`` into a temp dir; return (files differing from ``root``, tmp)."""
    tmp = Path(tempfile.mkdtemp(prefix="remp-protogen-"))
    fresh = generate(tmp, root / "protos")
    stale = [
        rel
        for rel in fresh
        if not (root / rel).exists() or not filecmp.cmp(tmp / rel, root / rel, shallow=False)
    ]
    return stale, tmp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if committed code is stale")
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    stale, tmp = stale_files(a.root)
    try:
        if a.check:
            if stale:
                print("generated code is stale; run: python -m remp.protogen", file=sys.stderr)
                for rel in stale:
                    print(f"  {rel}", file=sys.stderr)
                return 1
            print("generated code is current")
            return 0
        for rel in stale:
            (a.root / rel).parent.mkdir(parents=True, exist_ok=True)
            (a.root / rel).write_bytes((tmp / rel).read_bytes())
        print(f"wrote {len(stale)} generated files")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
