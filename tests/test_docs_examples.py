"""Every example in README.md, CONTRIBUTING.md and docs/ runs as written and shows what it prints.

The rules (which blocks run, how expected output is written, how a block is skipped and why)
are in CONTRIBUTING.md, "Documentation examples". One test per code block, named ``FILE:LINE``;
the tests that only read the documents (the extractor, the links, the flags) are fast."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
LANGUAGES = ("bash", "python", "console")  # blocks in other languages are shown output
COMMAND_TIMEOUT_S = 180
SERVER_ADDRESSES = ("localhost:8000", "127.0.0.1:8000")

# What CI's 2-core CPU machine cannot run; a block with a line that matches is skipped with the
# reason. Anything else that cannot run says why in a ``<!-- no-test: REASON -->`` line.
SKIP_RULES = [
    (re.compile(r"--device cuda|-m \"gpu"), "needs a CUDA device"),
    (re.compile(r"\btorchrun\b"), "needs several machines or GPUs (torchrun)"),
    (re.compile(r"\bpip install\b"), "installs packages from the network"),
    (re.compile(r"\blm_eval\b"), "downloads an evaluation dataset (lm-eval)"),
    (re.compile(r"\bengramrt serve\b"), "starts a server that runs until it is stopped"),
    (re.compile(r"\bpytest\b|\.ci/run"), "runs the test suite, which CI runs anyway"),
]
MARKER = re.compile(r"^\s*<!--\s*([\w-]+)\s*:\s*(.*?)\s*-->\s*$")
MARKER_KEYS = ("no-test", "exit")
FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)\s*$")

# `engramrt` and `python` run this checkout's code with the test's interpreter
PRELUDE = 'engramrt() { "$DOCS_PYTHON" -m engramrt "$@"; }\npython() { "$DOCS_PYTHON" "$@"; }\n'


@dataclass
class Command:
    text: str
    line: int  # in the document
    expected: list[str] = field(default_factory=list)  # output lines shown after it


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    body: str
    markers: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def marker(self, key: str) -> str | None:
        return next((value for k, value in self.markers if k == key), None)

    @property
    def needs_server(self) -> bool:
        return any(address in self.body for address in SERVER_ADDRESSES)

    def skip_reason(self) -> str | None:
        reason = self.marker("no-test")
        if reason is not None:
            return reason
        for pattern, why in SKIP_RULES:
            if pattern.search(self.body):
                return why
        return None


# --- reading the documents -------------------------------------------------------------------


def extract(path: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of ``path`` in LANGUAGES, with the markers on the lines above each."""
    lines = (path.read_text() if text is None else text).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence, language = opening.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        body = [
            line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]
        ]
        if language in LANGUAGES:
            blocks.append(Block(path, i + 1, language, "\n".join(body), _markers_above(lines, i)))
        i = end + 1
    return blocks


def _markers_above(lines: list[str], fence: int) -> tuple[tuple[str, str], ...]:
    found, k = [], fence - 1
    while k >= 0 and (not lines[k].strip() or MARKER.match(lines[k])):
        if lines[k].strip():
            found.append(MARKER.match(lines[k]).groups())
        k -= 1
    return tuple(reversed(found))


def shell_commands(block: Block) -> list[Command]:
    """A bash block's commands; whole-line comments right after one are its expected output."""
    commands: list[Command] = []
    lines, i, open_output = block.body.splitlines(), 0, False
    while i < len(lines):
        stripped = lines[i].strip()
        if not stripped:
            open_output = False
        elif stripped.startswith("#"):
            if open_output:
                commands[-1].expected.append(stripped[1:])
        else:
            start, text = i, lines[i]
            while text.endswith("\\") and i + 1 < len(lines):
                i += 1
                text += "\n" + lines[i]
            commands.append(Command(text, block.line + 1 + start))
            open_output = True
        i += 1
    return commands


def console_commands(block: Block) -> list[Command]:
    """A transcript's ``$ command`` lines, each followed by its output."""
    commands: list[Command] = []
    lines, i = block.body.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("$ "):
            start, text = i, lines[i][2:]
            while text.endswith("\\") and i + 1 < len(lines):
                i += 1
                text += "\n" + lines[i]
            commands.append(Command(text, block.line + 1 + start))
        elif commands:
            commands[-1].expected.append(lines[i])
        elif lines[i].strip():
            raise AssertionError(f"{block.name}: a transcript starts with a '$ ' command")
        i += 1
    return commands


def python_expectations(block: Block) -> list[str]:
    """Whole-line comments right after a line that calls print(: what it prints, in order."""
    groups: list[str] = []
    after_print = False
    for line in block.body.splitlines():
        stripped = line.strip()
        if after_print and stripped.startswith("#"):
            groups[-1] += stripped[1:]
            continue
        after_print = "print(" in stripped and not stripped.startswith("#")
        if after_print:
            groups.append("")
    return [g for g in groups if g.strip()]


def output_pattern(expected: list[str]) -> re.Pattern:
    """Expected output as a pattern over whitespace-free text, ``...`` standing for anything."""
    parts = "".join(re.sub(r"\s+", "", line) for line in expected).split("...")
    return re.compile(".*?".join(re.escape(p) for p in parts), re.DOTALL)


def shows(expected: list[str], output: str, whole: bool = False) -> bool:
    pattern, text = output_pattern(expected), re.sub(r"\s+", "", output)
    return bool(pattern.fullmatch(text) if whole else pattern.search(text))


ALL_BLOCKS = [block for path in DOC_FILES for block in extract(path)]


# --- running them ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docs_server() -> Iterator[str]:
    """``engramrt serve`` on the bundled model, for the examples that talk to localhost:8000."""
    from tests.support.server_fixture import start_server, stop_server

    base_url, proc = start_server(model=None)
    try:
        yield base_url.removeprefix("http://")
    finally:
        stop_server(proc)


def _environment() -> dict[str, str]:
    # the examples show CPU output; those that need CUDA are skipped
    env = dict(os.environ, DOCS_PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _localise(text: str, tmp: Path, server: str | None) -> str:
    text = text.replace("/tmp/", f"{tmp}/")
    for address in SERVER_ADDRESSES:
        if server is not None:
            text = text.replace(address, server)
    return text


def _run(argv: list[str], where: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            argv,
            cwd=ROOT,
            env=_environment(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{where}: still running after {COMMAND_TIMEOUT_S} s")


# A command shown in several places runs once: its output is the same wherever it is shown.
# Commands that write files (a /tmp/ path) always run, in their block's own directory.
_RESULTS: dict[tuple[str, bool], subprocess.CompletedProcess] = {}


def _run_command(command: Command, where: str, tmp: Path, server: str | None):
    key = (command.text, server is not None)
    if key in _RESULTS:
        return _RESULTS[key]
    script = PRELUDE + "set -o pipefail\n" + _localise(command.text, tmp, server)
    done = _run(["bash", "-c", script], where)
    if "/tmp/" not in command.text:
        _RESULTS[key] = done
    return done


def _check_commands(block: Block, commands: list[Command], tmp: Path, server: str | None) -> None:
    exit_code = int(block.marker("exit") or 0)
    for command in commands:
        where = f"{block.path.relative_to(ROOT)}:{command.line}"
        done = _run_command(command, where, tmp, server)
        report = f"{where}: {command.text}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
        assert done.returncode == exit_code, f"exit {done.returncode}, not {exit_code}\n{report}"
        if command.expected:
            whole = block.language == "console"
            assert shows(command.expected, done.stdout, whole), (
                f"the output is not what the document shows:\n{chr(10).join(command.expected)}\n"
                + report
            )


def _check_python(block: Block, tmp: Path, server: str | None) -> None:
    done = _run([sys.executable, "-c", _localise(block.body, tmp, server)], block.name)
    report = f"{block.name}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert done.returncode == 0, report
    expected = python_expectations(block)
    assert shows(["...".join(expected)], done.stdout), f"expected, in order: {expected}\n{report}"


def _params() -> list:
    params = []
    for block in ALL_BLOCKS:
        reason = block.skip_reason()
        marks = (
            [pytest.mark.skip(reason=f"{block.name}: {reason}")] if reason else [pytest.mark.slow]
        )
        params.append(pytest.param(block, id=block.name, marks=marks))
    return params


@pytest.mark.parametrize("block", _params())
def test_example_runs_as_written(block: Block, tmp_path: Path, request) -> None:
    server = request.getfixturevalue("docs_server") if block.needs_server else None
    if block.language == "python":
        _check_python(block, tmp_path, server)
    elif block.language == "console":
        _check_commands(block, console_commands(block), tmp_path, server)
    else:
        _check_commands(block, shell_commands(block), tmp_path, server)


# --- the documents themselves ----------------------------------------------------------------


def test_the_documents_have_runnable_examples() -> None:
    runnable = [b for b in ALL_BLOCKS if b.skip_reason() is None]
    assert len(runnable) >= 15, [b.name for b in runnable]
    assert {b.language for b in runnable} == set(LANGUAGES)
    # the front page's answers are tested, not only shown
    readme = [b for b in ALL_BLOCKS if b.path.name == "README.md"]
    assert sum(b.skip_reason() is None and b.needs_server for b in readme) >= 2
    assert sum(len(shell_commands(b)) for b in runnable if b.language == "bash") >= 20
    assert sum(bool(c.expected) for b in runnable for c in shell_commands(b)) >= 10


def test_every_marker_is_known_and_every_skip_says_why() -> None:
    for block in ALL_BLOCKS:
        for key, value in block.markers:
            assert key in MARKER_KEYS, f"{block.name}: unknown marker {key!r}"
            assert value, f"{block.name}: the {key} marker needs a value"
        if block.marker("exit") is not None:
            assert block.marker("exit").isdigit(), block.name
        if block.skip_reason() is not None:
            assert len(block.skip_reason()) > 10, f"{block.name}: say why it cannot run"


def test_the_readme_opens_with_the_set_up_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[0] == "# engramrt"
    first = extract(ROOT / "README.md")[0]
    install, test = first.body.splitlines()
    assert first.language == "bash" and install.endswith("engramrt serve")
    assert "pytest" in test and "ruff check" in test and "ruff format --check" in test


def test_the_extractor_and_the_checks_can_fail() -> None:
    doc = "\n".join(
        [
            "text",
            "<!-- exit: 1 -->",
            "```bash",
            "engramrt generate --prompt 'x' \\",
            "  --max-tokens 2",
            "#  Tarlo.",
            "",
            "# a note",
            "engramrt engram-hash --text x",
            "```",
            "",
            "```console",
            "$ engramrt check-pp",
            "partition  result",
            "1,5        ok",
            "```",
            "```json",
            '{"not": "an example"}',
            "```",
            "<!-- no-test: needs a thing this machine lacks -->",
            "```python",
            "print(1 + 1)",
            "# 2",
            "```",
        ]
    )
    blocks = extract(ROOT / "x.md", doc)
    assert [b.language for b in blocks] == ["bash", "console", "python"]
    bash, console, python = blocks
    assert bash.marker("exit") == "1" and bash.skip_reason() is None
    commands = shell_commands(bash)
    assert [c.line for c in commands] == [4, 9]
    assert commands[0].expected == ["  Tarlo."] and commands[1].expected == []
    assert console_commands(console)[0].expected == ["partition  result", "1,5        ok"]
    assert python.skip_reason() == "needs a thing this machine lacks"
    assert python_expectations(python) == [" 2"]
    assert shows(commands[0].expected, "engramrt: log\n Tarlo.\n")
    assert not shows(commands[0].expected, " Paris.")
    assert shows(['{"id":"cmpl-...","text":" Tarlo."'], '{"id":"cmpl-1f","text":" Tarlo.","x":1}')
    assert not shows(["partition result", "1,5 ok"], "partition result\n1,5 MISMATCH", whole=True)
    assert not shows(["a", "b"], "a\nb\nc", whole=True)


# --- links and flags -------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_links_between_the_documents_resolve() -> None:
    for path in DOC_FILES:
        for target in LINK.findall(path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            assert resolved.exists(), f"{path.relative_to(ROOT)}: no file {target}"
            if anchor:
                assert anchor in _anchors(resolved), f"{path.relative_to(ROOT)}: no #{anchor}"


# flags of other programs that the documents show
OTHER_FLAGS = {
    "--help",  # argparse's own
    "--index-url",  # pip
    "--no-deps",
    "--nnodes",  # torchrun
    "--node-rank",
    "--nproc-per-node",
    "--model",  # lm_eval
    "--tasks",
    "--model_args",
    "--check",  # ruff format
    "--dist",  # pytest-xdist
    "--suite",  # python -m benchmarks.run, the suite runner
}


def _argparse_flags() -> set[str]:
    """Every ``--flag`` an ``add_argument`` call in engramrt/ or benchmarks/ defines."""
    flags = set()
    for path in [*(ROOT / "engramrt").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    return {f for f in flags if isinstance(f, str) and f.startswith("--")}


def test_every_flag_the_documents_name_exists() -> None:
    known = _argparse_flags() | OTHER_FLAGS
    for path in DOC_FILES:
        text = path.read_text()
        for flag in re.findall(r"(?<![\w-])--\[?(?:no-\])?[a-z][\w-]*", text):
            flag = flag.replace("[no-]", "").replace("[", "")
            if flag.startswith("--no-") and "--" + flag[5:] in known:
                continue  # the negation argparse adds to a boolean flag
            assert flag in known, f"{path.relative_to(ROOT)}: {flag} is no flag of engramrt's"
