#!/usr/bin/env python3
"""Which @triton.jit functions differ between two trees (AST, docstrings and formatting aside):
a refactor that moves kernels between files but leaves them all identical changes no GPU code.

    python scripts/jit_ast_diff.py REV_A REV_B        # two commits of this repository
    python scripts/jit_ast_diff.py DIR_A DIR_B        # two moekit/ folders

Exit 0 when every kernel is identical, 1 otherwise (the differing names are printed)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile


def jit_functions(root: str) -> dict[str, list[str]]:
    """name -> AST dumps of every @triton.jit function under ``root`` (docstring dropped)."""
    out: dict[str, list[str]] = {}
    for d, _, files in os.walk(root):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            with open(os.path.join(d, f)) as fh:
                tree = ast.parse(fh.read())
            for node in ast.walk(tree):
                if not isinstance(node, ast.FunctionDef):
                    continue
                if not any("jit" in ast.unparse(dec) for dec in node.decorator_list):
                    continue
                body = node.body
                if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                    body = body[1:]
                node.body = body or [ast.Pass()]
                out.setdefault(node.name, []).append(ast.dump(node, annotate_fields=False, include_attributes=False))
    return out


def _tree(spec: str, tmp: str) -> str:
    if os.path.isdir(spec):
        return spec
    dest = os.path.join(tmp, spec)
    os.makedirs(dest)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    archive = subprocess.run(["git", "-C", root, "archive", spec, "moekit"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return os.path.join(dest, "moekit")


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        a, b = (jit_functions(_tree(s, tmp)) for s in sys.argv[1:])
    differ = [n for n in sorted(set(a) | set(b)) if sorted(a.get(n, [])) != sorted(b.get(n, []))]
    for n in differ:
        print(f"differs: {n} ({len(a.get(n, []))} -> {len(b.get(n, []))} definitions)")
    print(f"{len(set(a) | set(b)) - len(differ)} @triton.jit functions identical, {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
