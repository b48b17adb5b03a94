"""The docs are complete: the API reference names every public name, the index links every
page, the README keeps its quick start. That every ```python snippet runs on its own and prints
what the doc shows is tests/docs/test_doc_snippets.py.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import mixprec

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _api_text() -> str:
    return (DOCS / "api.md").read_text(encoding="utf-8")


def _public_names() -> set[str]:
    """Every name a user imports: the root's, and those of its public submodules."""
    names = set(mixprec.__all__)
    for sub in ("errors", "types", "distributed"):
        names |= {f"{sub}.{n}" for n in getattr(mixprec, sub).__all__}
    return names


def test_api_reference_names_every_public_name() -> None:
    headings = set(re.findall(r"^#{2,4} `mixprec\.([\w.]+)`", _api_text(), re.M))
    public = _public_names()
    missing = sorted(public - headings)
    assert not missing, f"add a '### `mixprec.NAME`' entry to docs/api.md for: {missing}"
    stale = sorted(headings - public)
    assert not stale, f"docs/api.md documents names that mixprec no longer exports: {stale}"


def test_root_stays_small() -> None:
    exported = [n for n in mixprec.__all__ if not n.startswith("__")]
    assert len(exported) <= 25, f"the root exports {len(exported)} names (at most 25)"


def _public_members(cls: type) -> list[str]:
    return [
        name
        for name, value in inspect.getmembers(cls)
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    ]


def test_api_reference_names_every_grad_scaler_method() -> None:
    text = _api_text()
    section = text[text.index("### `mixprec.GradScaler`") :]
    section = section[: section.index("\n### ", 5)]
    missing = [n for n in _public_members(mixprec.GradScaler) if f"`{n}" not in section]
    assert not missing, f"document these GradScaler methods in docs/api.md's table: {missing}"


def test_index_links_every_page() -> None:
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]*)?\)", index))
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    assert not pages - linked, f"link these pages from docs/index.md: {sorted(pages - linked)}"
    assert not linked - pages, f"docs/index.md links missing pages: {sorted(linked - pages)}"


def test_readme_keeps_the_quick_start_and_links() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make demo" in readme and "make test" in readme
    for target in re.findall(r"\]\(((?:docs|examples)/[^)#]*)", readme):
        assert (ROOT / target).exists(), f"README.md links {target}, which does not exist"


GPU_NAME = re.compile(r"\b(?:H100|H200|B200|B300)\b", re.I)
GPU_NOTE = "performance.md#gpu-figures-predicted-quoted-measured"


def test_pages_that_name_a_gpu_say_which_figures_are_predicted_or_measured() -> None:
    """A page that names a GPU links the note on what is predicted (the speed model), quoted and
    measured, which says how to measure (``benchmarks/gpu_check.py``); the note's heading is
    there."""
    performance = (DOCS / "performance.md").read_text(encoding="utf-8")
    assert "## GPU figures: predicted, quoted, measured" in performance
    assert "benchmarks/gpu_check.py" in performance.split("## GPU figures", 1)[1].split("\n## ")[0]
    naming = [p for p in sorted(DOCS.glob("*.md")) if GPU_NAME.search(p.read_text("utf-8"))]
    assert naming, "no page names a GPU: the check below checks nothing"
    missing = [
        p.name
        for p in naming
        if p.name != "performance.md" and GPU_NOTE not in p.read_text(encoding="utf-8")
    ]
    assert not missing, f"link [GPU figures...]({GPU_NOTE}) from {missing}"
