"""Regenerate (or check) the committed Python stubs of protos/specd.proto.

    python protos/regen.py            # rewrite protos/specd_pb2{.py,.pyi,_grpc.py} in place
    python protos/regen.py --check    # regenerate into a temp dir; exit 1 + diff summary on drift
    python protos/regen.py --check --root DIR   # the same for another checkout (used by tests)

protoc runs from the repository root with `-I .`, so the stubs import each other
package-qualified (`from protos import specd_pb2`) and embed the proto's path as
"protos/specd.proto". Requires grpcio-tools (the dev extra); the generated code
itself needs only grpcio and protobuf at run time.
"""
from __future__ import annotations

import argparse
import difflib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROTO = "protos/specd.proto"
STUBS = ("protos/specd_pb2.py", "protos/specd_pb2.pyi", "protos/specd_pb2_grpc.py")
REPO_ROOT = Path(__file__).resolve().parent.parent


def generate(root: Path, out: Path) -> None:
    """Run protoc on root/PROTO (include path `root`), writing the stubs under out/protos/."""
    (out / "protos").mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I", ".",
           f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", PROTO]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"protoc failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}")


def check(root: Path = REPO_ROOT) -> list[str]:
    """Regenerate root's proto into a temp dir; return one line per stub that differs (empty = in sync)."""
    problems = []
    with tempfile.TemporaryDirectory(prefix="specd-protos-") as tmp:
        generate(root, Path(tmp))
        for rel in STUBS:
            fresh = (Path(tmp) / rel).read_text()
            committed_path = root / rel
            if not committed_path.exists():
                problems.append(f"{rel}: missing (run `make protos`)")
                continue
            committed = committed_path.read_text()
            if fresh != committed:
                diff = list(difflib.unified_diff(committed.splitlines(), fresh.splitlines(),
                                                 f"committed/{rel}", f"regenerated/{rel}", lineterm="", n=0))
                changed = sum(1 for d in diff if d[:1] in "+-" and d[:3] not in ("+++", "---"))
                preview = "\n".join("    " + d for d in diff[:12])
                problems.append(f"{rel}: differs from regenerated stub ({changed} changed lines)\n{preview}")
    return problems


def regen(root: Path = REPO_ROOT) -> None:
    """Regenerate the stubs in place under root/protos/."""
    with tempfile.TemporaryDirectory(prefix="specd-protos-") as tmp:
        generate(root, Path(tmp))
        for rel in STUBS:
            shutil.copyfile(Path(tmp) / rel, root / rel)
            print(f"wrote {rel}")


def _tools_version() -> str:
    try:
        from importlib.metadata import version
        return version("grpcio-tools")
    except Exception:  # not installed: generate() already failed with a clear message
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 if the committed stubs differ from freshly generated ones")
    ap.add_argument("--root", type=Path, default=REPO_ROOT,
                    help="repository root holding protos/specd.proto (default: this checkout)")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    if args.check:
        problems = check(root)
        if problems:
            print(f"stubs out of date with {PROTO}; run `make protos` (stubs regenerated with "
                  f"grpcio-tools {_tools_version()}):", file=sys.stderr)
            for p in problems:
                print("  " + p, file=sys.stderr)
            return 1
        print(f"stubs up to date with {PROTO}")
        return 0
    regen(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
