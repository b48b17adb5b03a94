"""The docs are true: every ```python block in docs/*.md and README.md runs, the API reference
names every public name, and the index links every page.

Each Markdown file's blocks run in order in one namespace, in a process of their own (forked by
tests/forked_runner.py after one import of torch and mixprec), with Python's default warning
filters, as a reader running them would see. A block opts out with ``# doc: no-run (reason)``
on its first line; the reason is required.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from tests.forked_runner import no_run_reason, python_blocks, run_files

import mixprec

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]
PER_FILE_TIMEOUT_S = 120

# Files that check the runner itself: (name, text, expected exit status, text expected in log).
RUNNER_CASES = {
    "shared_namespace.md": (
        "```python\nx = 41\n```\ntext\n```py\nx += 1\nassert x == 42\n```\n",
        0,
        "2 block(s)",
    ),
    "failing.md": (
        "# t\n\n```python\nok = 1\n```\n\n```python\nraise ValueError('boom')\n```\n",
        1,
        "line 8",
    ),
    "no_reason.md": ("```python\n# doc: no-run\nraise SystemExit(9)\n```\n", 3, "needs a reason"),
    "skipped.md": (
        "```python\n# doc: no-run (needs 2 processes)\nraise SystemExit(9)\n```\n",
        0,
        "skipped (needs 2 processes)",
    ),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    cases = tmp_path_factory.mktemp("runner-cases")
    for name, (text, _, _) in RUNNER_CASES.items():
        (cases / name).write_text(text)
    paths = [str(p) for p in PAGES] + [str(cases / name) for name in RUNNER_CASES]
    logdir = str(tmp_path_factory.mktemp("doc-logs"))
    offline = {"HF_HUB_OFFLINE": "1"}  # docs/transformers.md builds its model; nothing downloads
    return run_files(paths, "markdown", logdir, PER_FILE_TIMEOUT_S, offline)


def _log(results: dict[str, dict[str, object]], name: str) -> tuple[object, str]:
    assert name in results, f"the runner stopped before {name}: {results['__runner__']}"
    return results[name]["rc"], Path(str(results[name]["log"])).read_text(errors="replace")


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_code_blocks_run(page: Path, results: dict[str, dict[str, object]]) -> None:
    rc, log = _log(results, page.name)
    assert rc == 0, f"{page.relative_to(ROOT)}: a python block failed (exit {rc}):\n{log[-4000:]}"


@pytest.mark.parametrize("name", RUNNER_CASES)
def test_runner_reports_failures_and_markers(
    name: str, results: dict[str, dict[str, object]]
) -> None:
    _, expected_rc, expected_text = RUNNER_CASES[name]
    rc, log = _log(results, name)
    assert rc == expected_rc, log
    assert expected_text in log, log


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_no_run_markers_give_a_reason(page: Path) -> None:
    for line, code in python_blocks(page.read_text(encoding="utf-8")):
        reason = no_run_reason(code)
        assert reason != "", f"{page.name}:{line}: write why next to '# doc: no-run (...)'"


def test_block_extraction() -> None:
    text = (
        "```python\na = 1\n```\n"
        "  ```py title='x'\n  b = 2\n  ```\n"
        "```bash\nnot python\n```\n"
        "````python\nc = '```'\n````\n"
    )
    blocks = python_blocks(text)
    assert [code for _, code in blocks] == ["a = 1", "b = 2", "c = '```'"]
    assert [line for line, _ in blocks] == [2, 5, 11]


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
