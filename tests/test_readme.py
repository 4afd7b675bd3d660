"""What a new user meets first: every ```python block of README.md runs as written (so the README cannot rot),
and installing gives no deprecation warning.

The rule: each block runs alone, as a new user who copies just that block would run it: in a fresh namespace
(``__name__ == "__main__"``) and a fresh temporary working folder, with nothing from the blocks before it. So every
block imports and defines what it uses. ```sh blocks are commands: each line of them runs too, in order, in a fresh
temporary folder per block, with the venv's ``attnkit`` and ``python`` first on the PATH; the set-up block (``make
demo``, ``make test``) is checked with ``make -n`` in the repository, since ``make test`` is what CI runs, and
running it from inside the suite would recurse.

The environment that ``torchrun`` gives its processes (rank 0 of a world of 1, a free local port) is set for every
block, so the ring attention block, written for ``torchrun``, runs here as a one-process gloo group; a block that
leaves a process group open fails its test, after the group is destroyed. Another test runs each block written for
``torchrun`` as its first line says (``# ring.py: torchrun --nproc-per-node 4 ring.py``), on that many processes.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks() -> list[tuple[str, int, str]]:
    """``(section heading, line of the opening fence, code)`` for each ```python block, in order."""
    text = README.read_text(encoding="utf-8")
    blocks, section, end = [], "top", 0
    for match in FENCE.finditer(text):
        headings = re.findall(r"^#+ (.*)$", text[end : match.start()], re.MULTILINE)  # outside code blocks
        section, end = (headings[-1] if headings else section), match.end()
        if match.group(1).strip() == "python":
            blocks.append((section, text.count("\n", 0, match.start()) + 1, match.group(2)))
    return blocks


BLOCKS = python_blocks()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Sections whose block runs as a world of 1 in make test-all only: importing DeepSpeed into this process takes
# about 30 s, and make test runs the block as written under torchrun on its 2 processes (below).
SLOW_SECTIONS = {"With DeepSpeed Ulysses"}


@pytest.mark.parametrize(
    ("section", "line", "code"),
    [pytest.param(*b, marks=[pytest.mark.slow] if b[0] in SLOW_SECTIONS else []) for b in BLOCKS],
    ids=[f"{s} (line {n})" for s, n, _ in BLOCKS],
)
def test_readme_python_block_runs_as_written(section, line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    # padded so that a traceback names the README's own line numbers
    compiled = compile("\n" * line + code, str(README), "exec")
    try:
        exec(compiled, {"__name__": "__main__"})
    finally:
        left_open = dist.is_available() and dist.is_initialized()
        if left_open:
            dist.destroy_process_group()
    assert not left_open, f"the block at README.md line {line} leaves a torch.distributed process group open"


TORCHRUN = re.compile(r"^# (\w+\.py): torchrun --nproc-per-node (\d+)")
TORCHRUN_BLOCKS = [(m.group(1), int(m.group(2)), code) for _, _, code in BLOCKS if (m := TORCHRUN.match(code))]
# cp.py's 4 processes finish their steps, then 2 of ~8 runs on a loaded 2-core machine aborted in gloo at exit
# ("terminate called without an active exception"), cause not found yet: make test-all runs it, make test its
# one-process form and tests/test_context_parallel.py the same FSDP2 x context_parallel training on 4 processes.
FLAKY_AT_EXIT = {"cp.py"}
SLOW_BLOCKS = FLAKY_AT_EXIT


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("name", "processes", "code"),
    [pytest.param(*b, marks=[pytest.mark.slow] if b[0] in SLOW_BLOCKS else []) for b in TORCHRUN_BLOCKS],
    ids=[b[0] for b in TORCHRUN_BLOCKS],
)
def test_the_torchrun_blocks_run_under_torchrun_on_the_processes_they_name(name, processes, code, tmp_path):
    (tmp_path / name).write_text(code)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_readme_has_its_python_blocks():
    assert [name for name, _, _ in TORCHRUN_BLOCKS] == ["ring.py", "cp.py", "ulysses.py"]
    sections = {section for section, _, _ in BLOCKS}
    assert {"Example", "Layers", "See inside", "Longer than one device: ring attention"} <= sections, sections


def test_no_python_block_hides_under_another_fence():
    """A block fenced ```py or ```python3 would look like Python to a reader but never be run here."""
    tags = {match.group(1).strip() for match in FENCE.finditer(README.read_text(encoding="utf-8"))}
    hidden = {tag for tag in tags if tag != "python" and tag.lower().startswith(("py", "ipython"))}
    assert not hidden, f"use ```python (run by this test) or a non-Python fence, not {sorted(hidden)}"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is new in Python 3.11")
def test_pyproject_license_is_an_spdx_string_for_a_setuptools_that_reads_it():
    """A TOML table (``{ text = "MIT" }``) makes setuptools >= 77 warn at every ``pip install``; a string needs 77."""
    import tomllib

    pyproject = tomllib.loads((README.parent / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["project"]["license"] == "MIT"
    assert "setuptools>=77" in pyproject["build-system"]["requires"]


def sh_blocks() -> list[tuple[int, str]]:
    """``(line of the opening fence, code)`` for each ```sh block, in order."""
    text = README.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1).strip() == "sh"
    ]


def _commands(code: str) -> list[str]:
    return [line for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize(("line", "code"), sh_blocks(), ids=[f"line {n}" for n, _ in sh_blocks()])
def test_every_sh_block_runs_as_written(line, code, tmp_path):
    commands = _commands(code)
    assert commands, f"README.md:{line}: an empty sh block"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if all(c.split()[0] == "make" for c in commands):
        targets = [c.split("#")[0].split()[1] for c in commands]
        done = subprocess.run(["make", "-n", *targets], cwd=README.parent, capture_output=True, text=True, env=env)
        assert done.returncode == 0, f"README.md:{line}: make -n {' '.join(targets)}: {done.stderr}"
        return
    for command in commands:
        done = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300
        )
        assert done.returncode == 0, f"README.md:{line}: {command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
