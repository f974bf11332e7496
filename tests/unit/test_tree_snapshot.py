"""benchmarks/tree_snapshot.sh: the device scripts run from a copy of the checkout taken at
their start (files rewritten in the checkout afterwards do not reach them), without the large
ignored folders, and the copy is gone when the script exits; SNAPSHOT=0 stays in place."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

HELPER = Path(__file__).resolve().parents[2] / "benchmarks" / "tree_snapshot.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

SCRIPT = """
. {helper}
snapshot_tree || exit 3
pwd
echo changed > {tree}/pkg/mod.py   # the checkout rewritten while the copy runs
cat pkg/mod.py
ls -a | tr '\\n' ' '
"""


def _tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "mod.py").write_text("original\n")
    for big in ("offline-wheels", ".venv", ".gl"):
        (tree / big).mkdir()
        (tree / big / "f").write_text("x")
    return tree


def _run(tree: Path, snapshot: str) -> list[str]:
    """The script's three lines: where it ran, the module's text there, the folder's names."""
    out = subprocess.run(["bash", "-c", SCRIPT.format(helper=HELPER, tree=tree)], cwd=tree,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SNAPSHOT": snapshot})
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_the_copy_is_taken_at_the_start_and_removed_at_exit(tmp_path):
    tree = _tree(tmp_path)
    where, content, listing = _run(tree, "1")
    assert where.startswith("/tmp/mokbench-tree.") and Path(where) != tree
    assert content == "original"
    assert "pkg" in listing.split()
    assert not {"offline-wheels", ".venv", ".gl"} & set(listing.split())
    assert not Path(where).exists()  # removed when the script exited


def test_snapshot_0_runs_in_the_checkout(tmp_path):
    where, content, _ = _run(_tree(tmp_path), "0")
    tree = tmp_path / "tree"
    assert Path(where) == tree and content == "changed"
