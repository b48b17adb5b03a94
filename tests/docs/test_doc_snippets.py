"""Every ```python snippet of README.md and docs/*.md runs on its own, as a user would paste it,
and prints what the doc says it prints.

How each snippet runs: written to a file of its own, in a folder of its own (blank lines
before it, so tracebacks give the doc's line numbers), and run as ``__main__`` by
tests/forked_runner.py in a process forked from a parent that has imported torch and mixprec
and nothing else (one thread, default warning filters); two such parents share the snippets,
started in the order of the tests, and each test waits for its own snippet's run only (one
test per snippet: none waits for them all).
Forking saves each snippet the import of torch (a few seconds) and is equivalent to a fresh
interpreter for what a snippet can observe: ``test_a_forked_snippet_sees_what_a_fresh_
interpreter_sees`` runs one snippet both ways and compares the state that matters (modules
loaded, threads, RNG, warning filters, grad mode, dtype defaults, globals). No snippet sees a
name of another: one that uses a name from a snippet above it fails with a NameError. What
differs from a user's paste on purpose (tests/doc_prelude.py): torch's and Python's generators
start from one fixed seed (a fresh interpreter's torch starts from a random one), so the test
repeats, and a value the doc shows that depends on an unseeded draw fails here; stdout is
recorded. Each snippet runs as a file saved anywhere: its folder is a temporary one outside the
repository and the working directory, and nothing of the repository is on ``sys.path`` but the
package (``src``, as installed): a snippet that imports ``examples.*`` or ``tests.*`` fails
(``test_a_snippet_sees_nothing_of_the_repository_but_the_package``).

What the doc says a snippet prints is checked in two forms:

- a ``# prints TEXT`` comment on a line: the text printed while that line ran (by ``print``
  calls on it or in what it called, all of them, runs of whitespace as one space) is TEXT;
- a ```text block right after a line ``<!-- doc: output -->``: it is the whole stdout of the
  nearest python snippet above it.

Text is compared line by line, runs of spaces as one space (table padding may change with a
number's width), ``...`` standing for any text; words and integers exactly; a number written
with a decimal point or an exponent within ``LAST_DIGITS`` units of its last shown digit. The
snippets run on one thread here; run once with 2 threads and with torch's, MKL's and oneDNN's
kernels held to SSE4 (``make test-other-cpu``'s settings), every shown value held and the
largest move was one unit of the last digit (docs/advisor.md's table: 64.9 to 64.8 dB, 0.03%
to 0.027%), so ``LAST_DIGITS = 2`` is twice that. A figure that depends on the machine (a time;
the fp8 flushed fractions of advisor.md's GPT table, decided by a few dozen values: 0.0097% on
one CPU, 0.0075% on another) is written ``...`` in the doc.

A snippet that cannot run on a CPU starts with ``# doc: no-run (reason)``; it is reported as
skipped with that reason. The reason is required.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests.forked_runner import FENCE, ForkPool, no_run_reason, python_blocks

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PRELUDE = ROOT / "tests" / "doc_prelude.py"
#: A test waits for its snippet's run after at most one run ahead of it per runner (below the
#: per-test timeout of 300 s, by a factor of 3 for the run itself).
PER_SNIPPET_TIMEOUT_S = 90
RUNNERS = min(2, os.cpu_count() or 1)  # runner processes at once (each forks one snippet at a time)
LAST_DIGITS = 2
#: The snippets run as a user who saved one to a file anywhere and ran it: the working directory
#: a temporary folder outside the repository, nothing of the repository on the path but the
#: package (``src``, as installed), nothing downloaded (docs/transformers.md).
RUN_ENV = {"PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}

OUTPUT_MARK = re.compile(r"^\s*<!--\s*doc:\s*output\s*-->\s*$")
PRINTS = re.compile(r"#\s*prints\b:?\s?(?P<text>.*?)\s*$")
NUMBER = re.compile(r"(?:(?<![\w.])[-+])?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


@dataclass(frozen=True)
class Snippet:
    """One ```python block and what its page says it prints."""

    page: Path
    line: int  # the doc line of its first code line
    code: str
    skip: str | None
    prints: tuple[tuple[int, str], ...]  # (doc line, text) of each `# prints` comment
    output: str | None = None  # the <!-- doc: output --> block after it
    output_line: int = 0

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"

    @property
    def file_name(self) -> str:
        return f"{self.page.name}-L{self.line}.py"


def output_blocks(text: str) -> list[tuple[int, str]]:
    """The blocks marked ``<!-- doc: output -->``: (line of the marker, 1-based; block text)."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if not OUTPUT_MARK.match(line):
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        m = FENCE.match(lines[j]) if j < len(lines) else None
        assert m, f"line {i + 1}: '<!-- doc: output -->' must be followed by a ``` block"
        end = j + 1
        while end < len(lines) and not lines[end].strip().startswith(m.group("fence")):
            end += 1
        found.append((i + 1, "\n".join(lines[j + 1 : end])))
    return found


def snippets(page: Path, text: str | None = None) -> list[Snippet]:
    """The page's python snippets, each with its `# prints` comments and output block."""
    text = page.read_text(encoding="utf-8") if text is None else text
    found = []
    for line, code in python_blocks(text):
        prints = tuple(
            (line + k, m.group("text"))
            for k, code_line in enumerate(code.split("\n"))
            if (m := PRINTS.search(code_line))
        )
        found.append(Snippet(page, line, code, no_run_reason(code), prints))
    for mark, block in output_blocks(text):
        above = [k for k, s in enumerate(found) if s.line < mark]
        assert above, f"{page.name}:{mark}: '<!-- doc: output -->' has no python snippet above it"
        s = found[above[-1]]
        assert s.output is None, f"{page.name}:{mark}: a second output block for {s.where}"
        found[above[-1]] = Snippet(s.page, s.line, s.code, s.skip, s.prints, block, mark)
    return found


ALL = [s for page in PAGES for s in snippets(page)]


# ----------------------------------------------------------------------------- comparing text


def _pieces(line: str) -> list[str]:
    """A line as words and numbers, spaces dropped: 'a 1.5e-3 (x2)' -> [a, 1.5e-3, (x, 2, )]."""
    out: list[str] = []
    for word in line.split():
        pos = 0
        for m in NUMBER.finditer(word):
            out += [p for p in (word[pos : m.start()], m.group()) if p]
            pos = m.end()
        if word[pos:]:
            out.append(word[pos:])
    return out


def _same_number(doc: str, run: str) -> bool:
    if not NUMBER.fullmatch(doc) or not NUMBER.fullmatch(run):
        return False
    if not any(c in doc for c in ".eE"):
        return doc.lstrip("+") == run.lstrip("+")  # integers exactly
    a, b = float(doc), float(run)
    digits = len(doc.split(".")[1].split("e")[0].split("E")[0]) if "." in doc else 0
    exponent = int(re.split("[eE]", doc)[1]) if re.search("[eE]", doc) else 0
    unit = 10.0 ** (exponent - digits)
    return abs(a - b) <= LAST_DIGITS * unit * (1 + 1e-9)


def line_differences(doc_line: str, run_line: str) -> str | None:
    """Why a printed line is not the doc's (None when it is, within the tolerances)."""
    a, b = _pieces(doc_line), _pieces(run_line)
    for x, y in zip(a, b, strict=False):
        if x != y and not _same_number(x, y):
            tolerant = NUMBER.fullmatch(x) and NUMBER.fullmatch(y) and any(c in x for c in ".eE")
            beyond = f" (by more than {LAST_DIGITS} units of its last digit)"
            return f"the doc shows {x!r} where the run printed {y!r}" + (beyond if tolerant else "")
    if len(a) != len(b):
        return f"the run printed {' '.join(b[len(a) :]) or 'less'!r} after the doc's text ends"
    return None


def _ellipsis_difference(doc: str, run: str) -> str | None:
    """Why ``run`` does not match ``doc``, in which each ``...`` stands for any text."""
    parts = []
    for k, chunk in enumerate(doc.split("...")):
        if k:
            parts.append(r"(?:.*?)")
        for n, word in enumerate(chunk.split()):
            pieces = _pieces(word)
            parts.append(r"\s+" if n > 0 else r"\s*")
            parts += [
                f"({NUMBER.pattern})" if NUMBER.fullmatch(p) else re.escape(p) for p in pieces
            ]
    m = re.fullmatch("".join(parts) + r"\s*", run.strip(), re.S)
    if m is None:
        return "the text does not match ('...' stands for any text)"
    numbers = [
        p for w in doc.replace("...", " ").split() for p in _pieces(w) if NUMBER.fullmatch(p)
    ]
    for x, y in zip(numbers, m.groups(), strict=True):
        if not _same_number(x, y):
            return f"the doc shows {x!r} where the run printed {y!r}"
    return None


def text_differences(doc: str, run: str) -> list[str]:
    """What differs between the text a doc shows and the text a run printed, line by line (a
    ``...`` within a line stands for any text in it; across lines when the counts differ)."""
    want, got = doc.rstrip().split("\n"), run.rstrip().split("\n")
    if len(want) != len(got) and "..." in doc:
        why = _ellipsis_difference(doc, run)
        return [] if why is None else [f"{why}\n    doc: {doc.strip()}\n    run: {run.strip()}"]
    if len(want) != len(got):
        return [f"the doc shows {len(want)} line(s), the run printed {len(got)}"]
    found = []
    for k, (x, y) in enumerate(zip(want, got, strict=True), 1):
        why = _ellipsis_difference(x, y) if "..." in x else line_differences(x, y)
        if why:
            found.append(f"line {k}: {why}\n    doc: {x.strip()}\n    run: {y.strip()}")
    return found


# ----------------------------------------------------------------------------- running


def write_snippet(s: Snippet, folder: Path) -> Path:
    """The snippet as a script whose lines are the doc's, in a folder of its own; line 1 runs the
    prelude."""
    (folder / s.file_name[:-3]).mkdir(exist_ok=True)
    path = folder / s.file_name[:-3] / s.file_name
    first = f"__import__('runpy').run_path({str(PRELUDE)!r}, {{'SNIPPET': __file__}})"
    path.write_text(first + "\n" * (s.line - 1) + s.code + "\n", encoding="utf-8")
    return path


@dataclass(frozen=True)
class Run:
    rc: object
    seconds: float
    log: str
    stdout: str
    prints: list[dict[str, object]]


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""


class SnippetRuns:
    """The snippets' scripts and the ``ForkPool`` that runs them: each test waits for its own."""

    def __init__(self, folder: Path, group: list[Snippet], first: list[Snippet]) -> None:
        self.scripts = {s.file_name: write_snippet(s, folder) for s in group if s.skip is None}
        self.pool = ForkPool(str(folder), PER_SNIPPET_TIMEOUT_S, RUNNERS, RUN_ENV, str(folder))
        self.pool.submit(str(self.scripts[s.file_name]) for s in first if s.skip is None)

    def __getitem__(self, name: str) -> Run:
        script = self.scripts[name]
        result = self.pool.result(str(script))
        prints = [json.loads(x) for x in _read(Path(f"{script}.prints.jsonl")).splitlines()]
        return Run(
            result["rc"],
            float(str(result["seconds"])),
            _read(Path(str(result["log"]))),
            _read(Path(f"{script}.stdout")),
            prints,
        )


def _in_test_order(items: list[pytest.Item], cases: list[Snippet]) -> list[Snippet]:
    """The snippets of the selected tests, in the order the tests run (the runner's cases once,
    where the first test that reads them runs)."""
    order: list[Snippet] = []
    for item in items:
        params = getattr(item, "callspec", None)
        snippet = params.params.get("snippet") if params is not None else None
        if isinstance(snippet, Snippet):
            order.append(snippet)
        elif "case_pages" in getattr(item, "fixturenames", ()) and cases[0] not in order:
            order += cases
    return order


def problems(s: Snippet, run: Run) -> list[str]:
    """What is wrong with one snippet's run, each naming the doc file and line."""
    if run.rc != 0:
        return [f"{s.where}: the snippet failed (exit {run.rc}); its output:\n{run.log[-4000:]}"]
    found = []
    for line, text in s.prints:
        printed = [str(p["text"]) for p in run.prints if line in p["lines"]]
        if not printed:
            found.append(f"{s.page.name}:{line}: '# prints {text}', but the line printed nothing")
            continue
        for why in text_differences(text, " ".join(" ".join(printed).split())):
            found.append(f"{s.page.name}:{line}: '# prints {text}': {why}")
    if s.output is not None:
        wrong = text_differences(s.output, run.stdout)
        if wrong:
            found.append(
                f"{s.page.name}:{s.output_line}: the output block of {s.where} is not what it "
                "prints:\n" + "\n".join(wrong) + f"\nIt printed:\n{run.stdout}"
            )
    return found


STATE_SNIPPET = """```python
import random, sys, warnings
import torch, mixprec

print(torch.get_num_threads(), torch.initial_seed(), torch.rand(2).tolist(), random.random())
print(torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"))
print(torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision())
print(warnings.filters)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "mixprec")))
print(__name__, sys.argv[1:], [k for k in globals() if not k.startswith("__")])
```
"""

OUTSIDE_SNIPPET = """```python
import importlib.util, json, os, sys

found = {name: importlib.util.find_spec(name) is not None for name in ("examples", "tests")}
print(json.dumps({"cwd": os.getcwd(), "path": sys.path, "importable": found}))
```
"""

# Pages that check the runner itself: name -> text.
RUNNER_CASES = {
    "case-names.md": "```python\nx = 41\n```\n\n```python\nprint(x + 1)  # prints 42\n```\n",
    "case-prints.md": (
        "```python\nprint(6 * 7)  # prints 42\nprint('a b')  # prints a c\n"
        "for k in range(2):\n    print(k / 3)  # prints 0.0 0.333\n```\n"
    ),
    "case-output.md": (
        "```python\nprint('loss 1.234')\nprint('steps 5')\n```\n\n<!-- doc: output -->\n"
        "```text\nloss   1.23\nsteps 5\n```\n\n"
        "```python\nprint('loss 1.234')\n```\n<!-- doc: output -->\n```text\nloss 1.50\n```\n"
    ),
    "case-state.md": STATE_SNIPPET,
    "case-skip.md": "```python\n# doc: no-run (needs 2 processes)\nraise SystemExit(9)\n```\n",
    "case-outside.md": OUTSIDE_SNIPPET,
}


@pytest.fixture(scope="module")
def case_pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Snippet]]:
    folder = tmp_path_factory.mktemp("runner-cases")
    pages = {}
    for name, text in RUNNER_CASES.items():
        (folder / name).write_text(text, encoding="utf-8")
        pages[name] = snippets(folder / name)
    return pages


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory,
    case_pages: dict[str, list[Snippet]],
    request: pytest.FixtureRequest,
) -> Iterator[SnippetRuns]:
    """Starts the runs, in the order of the tests, and returns at once: each test waits for its
    own snippet's run only."""
    cases = [s for group in case_pages.values() for s in group]
    first = _in_test_order(request.session.items, cases)
    runs = SnippetRuns(tmp_path_factory.mktemp("doc-snippets"), ALL + cases, first)
    yield runs
    runs.pool.close()


@pytest.mark.parametrize("snippet", ALL, ids=[s.where for s in ALL])
def test_snippet_runs_on_its_own_and_prints_what_the_doc_shows(
    snippet: Snippet, runs: SnippetRuns
) -> None:
    if snippet.skip is not None:
        pytest.skip(f"{snippet.where}: {snippet.skip}")
    wrong = problems(snippet, runs[snippet.file_name])
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_no_run_markers_give_a_reason(page: Path) -> None:
    for s in snippets(page):
        assert s.skip != "", f"{s.where}: write why next to '# doc: no-run (...)'"


def _problems(case: list[Snippet], runs: SnippetRuns) -> list[list[str]]:
    return [problems(s, runs[s.file_name]) for s in case]


def test_a_snippet_does_not_see_the_names_of_the_one_above(
    case_pages: dict[str, list[Snippet]], runs: SnippetRuns
) -> None:
    first, second = _problems(case_pages["case-names.md"], runs)
    assert first == []
    assert len(second) == 1 and "case-names.md:6" in second[0], second
    assert "NameError: name 'x' is not defined" in second[0] and "line 6" in second[0], second


def test_prints_comments_are_checked_line_by_line(
    case_pages: dict[str, list[Snippet]], runs: SnippetRuns
) -> None:
    (wrong,) = _problems(case_pages["case-prints.md"], runs)
    assert len(wrong) == 1, wrong  # 6 * 7 is 42; the loop's line printed 0.0 and 0.333...
    assert "case-prints.md:3: '# prints a c'" in wrong[0], wrong
    assert "the doc shows 'c' where the run printed 'b'" in wrong[0], wrong


def test_output_blocks_are_the_whole_stdout(
    case_pages: dict[str, list[Snippet]], runs: SnippetRuns
) -> None:
    good, bad = _problems(case_pages["case-output.md"], runs)
    assert good == []  # 1.234 shown as 1.23, other padding
    assert len(bad) == 1 and "case-output.md:15: the output block of" in bad[0], bad
    assert "the doc shows '1.50' where the run printed '1.234'" in bad[0], bad


def test_a_no_run_snippet_is_reported_skipped_with_its_reason(
    case_pages: dict[str, list[Snippet]],
) -> None:
    (s,) = case_pages["case-skip.md"]
    assert s.skip == "needs 2 processes"


def test_a_forked_snippet_sees_what_a_fresh_interpreter_sees(
    case_pages: dict[str, list[Snippet]], runs: SnippetRuns, tmp_path: Path
) -> None:
    """The fork's equivalence, on what a snippet can observe (the seed is the prelude's, in
    both); a fresh interpreter started outside the repository, as a user who saved the block."""
    (s,) = case_pages["case-state.md"]
    forked = runs[s.file_name]
    assert forked.rc == 0, forked.log
    script = write_snippet(s, tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **RUN_ENV}
    fresh = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True
    )
    assert fresh.returncode == 0, fresh.stderr.decode()[-3000:]
    assert forked.stdout == Path(f"{script}.stdout").read_text(encoding="utf-8")


def test_a_snippet_sees_nothing_of_the_repository_but_the_package(
    case_pages: dict[str, list[Snippet]], runs: SnippetRuns
) -> None:
    """As a block saved to a file anywhere and run: ``examples`` and ``tests`` cannot be imported,
    the working directory is outside the repository, and the only path entry inside it is
    ``src`` (the package, as installed)."""
    (s,) = case_pages["case-outside.md"]
    run = runs[s.file_name]
    assert run.rc == 0, run.log
    seen = json.loads(run.stdout)
    assert seen["importable"] == {"examples": False, "tests": False}, seen
    assert not Path(seen["cwd"]).resolve().is_relative_to(ROOT), seen["cwd"]
    env = Path(sys.prefix).resolve()  # the virtual environment (make's .venv lies in the clone)
    paths = {Path(p).resolve() for p in seen["path"]}
    inside = {p for p in paths if p.is_relative_to(ROOT) and not p.is_relative_to(env)}
    assert inside <= {ROOT / "src"}, inside


@pytest.mark.parametrize(
    ("doc", "run", "same"),
    [
        ("64.9 dB", "65.0 dB", True),  # the last digit, once rounded the other way
        ("64.9 dB", "65.2 dB", False),
        ("-0.3 dB", "-0.2 dB", True),
        ("0.0081%", "0.0082%", True),
        ("0.0081%", "0.0090%", False),
        ("1.24e+05", "1.25e+05", True),
        ("1.24e+05", "1.27e+05", False),
        ("273 outputs", "274 outputs", False),  # integers exactly
        ("fp16 (7 passes)", "fp16 (8 passes)", False),
        ("policy: 0=fp8", "policy: nn.Linear=fp8", False),
        ("a    b", "a b", True),  # padding
        ("inf", "-inf", False),
        ("... of 2 parameter(s) ...", "Got 3 of 2 parameter(s): a, b", True),
        ("... of 2 parameter(s) ...", "Got 3 of 3 parameter(s): a, b", False),
        ("a 1.0\nb ...% go\nc", "a 1.0\nb 0.0079% go\nc", True),  # a cell the CPU moves
        ("a 1.0\nb ...% go\nc", "a 1.0\nb 0.0079% in\nc", False),
    ],
)
def test_the_tolerances(doc: str, run: str, same: bool) -> None:
    assert (text_differences(doc, run) == []) is same


#: Code a page's blocks show (each block holding what it uses, so that it runs on its own) and an
#: example holds: the same in every block that shows it.
SHARED = [
    ("docs/advisor.md", "examples/advise_fp16.py", ("Net", "Block", "loss_fn")),
    ("docs/advisor.md", "examples/advise_gpt.py", ("GPT", "Block", "SelfAttention", "make_gpt")),
    ("docs/lightning.md", "examples/lightning_regressor.py", ("Regressor",)),
    ("docs/lightning.md", "examples/lightning_regressor.py", ("overflowing_data",)),
    ("docs/transformers.md", "examples/hf_trainer.py", ("Tokens", "tiny_gpt2", "trainer_for")),
    (
        "docs/transformers.md",
        "examples/hf_trainer_fp8.py",
        ("small_gpt2", "TokenBatches", "fp8_trainer"),
    ),
]


def _definitions(code: str) -> dict[str, str]:
    tree = ast.parse(code)
    return {
        node.name: ast.dump(node)
        for node in tree.body
        if isinstance(node, ast.ClassDef | ast.FunctionDef)
    }


@pytest.mark.parametrize(("page", "example", "names"), SHARED)
def test_the_code_a_page_shows_is_the_example_its_snippets_import(
    page: str, example: str, names: tuple[str, ...]
) -> None:
    """Each block that shows the first name shows every name as the example defines it."""
    held = _definitions((ROOT / example).read_text(encoding="utf-8"))
    blocks = [shown for s in snippets(ROOT / page) if names[0] in (shown := _definitions(s.code))]
    assert blocks, f"{page} shows no `{names[0]}`"
    for shown, name in ((shown, name) for shown in blocks for name in names):
        assert name in shown and shown[name] == held[name], (
            f"{page} shows `{name}` and {example} defines it: make them the same code"
        )


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
    marked = "```python\nprint(1)\n```\n<!-- doc: output -->\n\n```text\n1\n```\n"
    assert output_blocks(marked) == [(4, "1")]
    (s,) = snippets(Path("x.md"), marked)
    assert (s.output, s.output_line, s.prints) == ("1", 4, ())
