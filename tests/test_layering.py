"""Each product folder imports only the layers docs/ARCHITECTURE.md's table allows, read from the table itself."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("frontend", "scheduler", "worker", "kernels", "protocol")


def allowed_imports() -> dict[str, set[str]]:
    """The layering table's rows: `folder/` -> the folders of ours it may import (itself always)."""
    rows = {}
    for line in (REPO / "docs" / "ARCHITECTURE.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        folder = re.fullmatch(r"`(\w+)/`", cells[0]) if len(cells) == 3 else None
        if folder and folder.group(1) in FOLDERS:
            rows[folder.group(1)] = set(re.findall(r"`(\w+)/`", cells[2])) | {folder.group(1)}
    return rows


def imported_folders(path: Path) -> set[str]:
    """Our folders that a file imports anywhere in it, inside functions too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {name.split(".")[0] for name in names} & set(FOLDERS)


def test_the_architecture_table_names_every_folder():
    assert set(allowed_imports()) == set(FOLDERS)


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_folder_imports_only_the_layers_below_it(folder):
    allowed = allowed_imports()[folder]
    wrong = {
        str(path.relative_to(REPO)): sorted(imported_folders(path) - allowed)
        for path in sorted((REPO / folder).rglob("*.py"))
        if imported_folders(path) - allowed
    }
    assert not wrong, f"{folder}/ may import only {sorted(allowed)} (docs/ARCHITECTURE.md): {wrong}"


def test_the_check_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from frontend.tokenizer import load_tokenizer\n")
    assert imported_folders(bad) == {"frontend"}
