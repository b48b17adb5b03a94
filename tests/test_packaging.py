"""What a user installs and reads: metadata, LICENSE, extras that exist, pinned test versions,
the README's install lines, and no internal words in user-facing text."""

from __future__ import annotations

import contextlib
import io
import re
import tokenize
from importlib import metadata
from pathlib import Path

import pytest

import mixprec
from mixprec.cli import main

ROOT = Path(__file__).resolve().parent.parent
META = metadata.distribution("mixprec").metadata  # built from pyproject.toml at install time
README = (ROOT / "README.md").read_text(encoding="utf-8")
MARKDOWN = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = sorted([*(ROOT / "src").rglob("*.py"), *(ROOT / "examples").glob("*.py")])


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _requirements() -> dict[str | None, list[str]]:
    """Requires-Dist by extra (None: the dependencies of the package itself)."""
    out: dict[str | None, list[str]] = {extra: [] for extra in META.get_all("Provides-Extra") or []}
    out[None] = []
    for line in META.get_all("Requires-Dist") or []:
        requirement, _, marker = line.partition(";")
        found = re.search(r"extra == \"([\w-]+)\"", marker)
        out[found.group(1) if found else None].append(requirement.strip())
    return out


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[_name(name)] = version
    return pins


def test_metadata_of_the_installed_distribution() -> None:
    dist = metadata.distribution("mixprec")
    assert dist.version == mixprec.__version__  # one version, in mixprec/__init__.py
    meta = dist.metadata
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert "LICENSE" in (meta.get_all("License-File") or [])
    assert meta["Author"] or meta["Author-email"]
    classifiers = meta.get_all("Classifier") or []
    assert "Programming Language :: Python :: 3 :: Only" in classifiers
    assert "Typing :: Typed" in classifiers
    assert any(c.startswith("Topic :: Scientific/Engineering") for c in classifiers)
    assert meta["Requires-Python"] == ">=3.10"


def test_license_file_is_bsd_3_clause() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("BSD 3-Clause License")
    assert "Neither the name of the copyright holder" in text
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'license = "BSD-3-Clause"' in pyproject and 'license-files = ["LICENSE"]' in pyproject


def test_every_mentioned_extra_exists_and_is_pinned() -> None:
    """Each `mixprec[...]` in the README, the docs and the messages of src/ names extras that
    pyproject declares, and every package an extra brings is pinned in constraints.txt (what
    `make test` installs)."""
    extras = {k: v for k, v in _requirements().items() if k is not None}
    texts = [p.read_text(encoding="utf-8") for p in [*MARKDOWN, *PYTHON]]
    mentioned = {
        extra.strip()
        for text in texts
        for group in re.findall(r"mixprec\[([a-z, -]+)\]", text)
        for extra in group.split(",")
    }
    assert mentioned, "expected install lines"
    assert mentioned <= set(extras), f"undeclared extras: {sorted(mentioned - set(extras))}"
    readme_extras = set(re.findall(r"^\| `(\w+)` \|", README, re.M))
    assert readme_extras == set(extras), "the README's extras table lists every extra"
    pins = _pins()
    missing = {_name(req) for reqs in extras.values() for req in reqs if _name(req) not in pins} - {
        "mixprec"
    }
    assert not missing, f"pin these in constraints.txt: {sorted(missing)}"


def test_the_pinned_torch_is_inside_the_declared_range_and_documented() -> None:
    (torch_requirement,) = [r for r in _requirements()[None] if _name(r) == "torch"]
    floor = re.findall(r">=\s*([\d.]+)", torch_requirement)[0]
    pinned = _pins()["torch"]
    as_tuple = [tuple(int(x) for x in v.split(".")[:2]) for v in (floor, pinned)]
    assert as_tuple[0] <= as_tuple[1]
    assert f"torch >= {floor}" in README and f"torch {pinned}" in README


def test_readme_install_lines_work_without_make() -> None:
    for line in (
        "pip install .",
        "pip install '.[plot,progress]'",
        "pip install -c constraints.txt",
        "mixprec @ git+URL",  # URL: the address the repository is cloned from
    ):
        assert line in README, line
    assert "LICENSE" in README and "CHANGELOG.md" in README


def test_makefile_installs_the_recipes_packages() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    pins = _pins()
    for package in ("transformers", "timm", "lightning", "pytorch-lightning"):
        assert package in pins, package
        assert package in makefile or package in str(_requirements()), package


# The internal word for the documents the project started from. Random seeds are fine.
INTERNAL = re.compile(
    r"\bseeds?(?:'s)?\s+(?:docs?|documents?|pages?|examples?|form|api|text)\b"
    r"|\bthe\s+seeds\b|\b(?:first|second|third|both)\s+seeds?\b|\bseeds/|\bseed's\b"
    r"|\bseed_update",
    re.IGNORECASE,
)


def _prose(path: Path) -> str:
    """A Python file's strings and comments (docstrings, messages), not its identifiers."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    return "\n".join(t.string for t in tokens if t.type in (tokenize.STRING, tokenize.COMMENT))


@pytest.mark.parametrize(
    "path", [*MARKDOWN, *PYTHON], ids=[str(p.relative_to(ROOT)) for p in [*MARKDOWN, *PYTHON]]
)
def test_no_internal_words_in_user_facing_text(path: Path) -> None:
    text = path.read_text(encoding="utf-8") if path.suffix == ".md" else _prose(path)
    found = INTERNAL.findall(text)
    assert not found, (
        f"{path.relative_to(ROOT)} says {found}: name what is meant (the torch.cuda.amp 1.5 "
        "API, a page that calls scaler.update(optimizer))"
    )


def test_no_internal_words_in_file_names_and_cli_help() -> None:
    names = [p.name for p in (ROOT / "examples").iterdir()] + [p.name for p in PYTHON]
    assert not [n for n in names if "seed" in n.lower()]
    assert (ROOT / "examples" / "update_with_optimizer.py").exists()
    helps = []
    for argv in ([], ["demo"], ["advise"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main([*argv, "--help"]) == 0
        helps.append(out.getvalue())
    assert all(helps) and not INTERNAL.findall("\n".join(helps))


def test_the_pattern_catches_the_internal_word_and_spares_random_seeds() -> None:
    for bad in ("the seed documents", "the second seed", "the seed's form", "seeds/001"):
        assert INTERNAL.search(bad), bad
    for fine in ("--seed 3", "torch.manual_seed(0)", "same seed, data", "re-seeds the masters"):
        assert not INTERNAL.search(fine), fine


def test_index_lists_each_page_once() -> None:
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    links = re.findall(r"^- \[([\w.-]+\.md)\]", index, re.M)
    assert len(links) == len(set(links)), sorted({n for n in links if links.count(n) > 1})
