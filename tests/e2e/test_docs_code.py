"""Every ```python block of README.md and docs/*.md runs, so the docs cannot drift from the code.

The blocks of one markdown file run in order, in one namespace, in a fresh Python process per
file (Keras and TensorFlow keep global state), with the working directory in a temporary folder
so that files an example writes land there.

Two HTML comments, invisible in the rendered docs, steer a block:

* ``<!-- docs-test: skip — <reason> -->`` on the line right before the fence: the block is not
  run (a timing benchmark, several machines, data not shipped, a ``...`` placeholder). The
  reason is required.
* ``<!-- docs-test: setup`` ... ``-->`` (the code on the lines between, no blank line) placed
  before a fence: the code runs in the file's namespace just before that block. It defines the
  names a fragment takes from the surrounding prose (``model``, ``x``, ``y``, ``T`` ...) and keeps
  them small (a few steps, a few hundred examples) so that the test stays fast.

One more, for a whole file: ``<!-- docs-test: backend jax -->`` (on a line of its own,
anywhere) runs that file's blocks with ``KERAS_BACKEND=jax`` instead of ``tensorflow``.
"""

import glob
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC_FILES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_SKIP = re.compile(r"^\s*<!--\s*docs-test:\s*skip\b(.*?)-->\s*$")
_SETUP_START = re.compile(r"^\s*<!--\s*docs-test:\s*setup\s*$")
_BACKEND = re.compile(r"^\s*<!--\s*docs-test:\s*backend\s+(tensorflow|jax)\s*-->\s*$")
_ANY_MARKER = re.compile(r"docs-test:")


def file_backend(path):
    """The Keras backend the blocks of ``path`` run with: ``tensorflow`` unless the file
    has a ``<!-- docs-test: backend NAME -->`` line."""
    for line in open(os.path.join(ROOT, path), encoding="utf-8"):
        match = _BACKEND.match(line)
        if match:
            return match.group(1)
    return "tensorflow"


@dataclass
class Block:
    path: str
    index: int  # 0-based among the file's python blocks
    line: int  # 1-based line of the opening fence
    code: str
    setup: str = ""
    skip: str | None = None  # the reason, when skipped

    @property
    def first_line(self):
        return next((s.strip() for s in self.code.splitlines() if s.strip()), "")

    def where(self):
        return f"{self.path} python block {self.index} (line {self.line}): {self.first_line!r}"


def parse_blocks(path):
    """``(blocks, problems)``: the ```python blocks of the markdown file ``path`` (relative to
    the repository root), in order, each with its hidden setup code and skip reason, and one line
    per malformed marker (a skip without a reason or not right before a fence, an unclosed setup,
    an unknown ``docs-test:`` word, a marker that precedes no python block)."""
    lines = open(os.path.join(ROOT, path), encoding="utf-8").read().split("\n")
    blocks, problems = [], []
    setup, skip = [], None
    i = 0
    while i < len(lines):
        text = lines[i]
        fence = _FENCE.match(text)
        if fence:
            indent, ticks, lang = fence.groups()
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith(ticks):
                end += 1
            if lang == "python":
                body = "\n".join(s[len(indent):] if s.startswith(indent) else s for s in lines[i + 1:end])
                blocks.append(Block(path, len(blocks), i + 1, body, "\n".join(setup), skip))
            elif setup or skip is not None:
                problems.append(f"{path}:{i + 1}: a docs-test marker precedes a ```{lang} block, not ```python")
            setup, skip = [], None
            i = end + 1
            continue
        match = _SKIP.match(text)
        if match:
            reason = re.sub(r"^\s*[—–:-]+\s*", "", match.group(1)).strip()
            if not reason:
                problems.append(f"{path}:{i + 1}: a docs-test skip without a reason: {text.strip()!r}")
            if i + 1 >= len(lines) or not _FENCE.match(lines[i + 1]):
                problems.append(f"{path}:{i + 1}: a docs-test skip must be on the line right before a fence")
            skip = reason or "(no reason)"
        elif _SETUP_START.match(text):
            end = i + 1
            while end < len(lines) and lines[end].strip() != "-->":
                end += 1
            if end == len(lines):
                problems.append(f"{path}:{i + 1}: a docs-test setup comment is not closed by a line '-->'")
            if any(not s.strip() for s in lines[i + 1:end]):
                problems.append(f"{path}:{i + 1}: a docs-test setup comment has a blank line (keep it one HTML block)")
            setup.extend(lines[i + 1:end])
            i = end
        elif _BACKEND.match(text):
            pass  # a whole file's backend: file_backend()
        elif _ANY_MARKER.search(text):
            problems.append(f"{path}:{i + 1}: an unknown docs-test marker: {text.strip()!r}")
        i += 1
    if setup or skip is not None:
        problems.append(f"{path}: a docs-test marker at the end of the file precedes no block")
    return blocks, problems


# The child: runs the blocks in order in one namespace; prints '@@ <index> <phase>' as it goes
# and exits 3 after the first failure, its traceback on stderr.
_DRIVER = r"""
import json, sys, time, traceback
blocks = json.load(open(sys.argv[1], encoding="utf-8"))
namespace = {"__name__": "__main__"}
for b in blocks:
    for phase, code in (("setup", b["setup"]), ("block", b["code"])):
        if not code.strip():
            continue
        print(f"@@ {b['index']} {phase}", flush=True)
        start = time.perf_counter()
        try:
            exec(compile(code, f"<{b['path']} python block {b['index']} {phase}>", "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            sys.exit(3)
        print(f"@@ {b['index']} {phase} done {time.perf_counter() - start:.1f} s", flush=True)
"""


def test_docs_markers_are_well_formed():
    problems = []
    for path in DOC_FILES:
        problems += parse_blocks(path)[1]
    assert not problems, "\n".join(problems)


def test_most_doc_blocks_run():
    blocks = [b for path in DOC_FILES for b in parse_blocks(path)[0]]
    ran = [b for b in blocks if b.skip is None]
    assert len(blocks) >= 30, f"only {len(blocks)} python blocks found in {DOC_FILES}"
    assert len(ran) >= len(blocks) // 2, (
        f"{len(blocks) - len(ran)} of {len(blocks)} blocks are skipped: "
        + "; ".join(f"{b.where()}: {b.skip}" for b in blocks if b.skip is not None))


@pytest.mark.slow  # about 90 s for all files on 2 loaded cores
@pytest.mark.parametrize("path", [p for p in DOC_FILES if parse_blocks(p)[0]])
def test_doc_code_blocks_run(path, tmp_path):
    blocks, problems = parse_blocks(path)
    assert not problems, "\n".join(problems)
    to_run = [b for b in blocks if b.skip is None]
    if not to_run:
        pytest.skip(f"{path}: no python block to run ({len(blocks)} skipped)")
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([{"path": b.path, "index": b.index, "setup": b.setup, "code": b.code}
                                for b in to_run]), encoding="utf-8")
    work = tmp_path / "cwd"
    work.mkdir()
    backend = file_backend(path)
    if backend == "jax":
        pytest.importorskip("jax", reason=f"{path} runs on the JAX backend: install the jax extra")
    env = dict(os.environ, PYTHONPATH=ROOT, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    try:
        proc = subprocess.run([sys.executable, "-c", _DRIVER, str(spec)], capture_output=True, text=True,
                              env=env, cwd=work, timeout=300)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = "timed out after 300 s", "timeout"
    started = re.findall(r"^@@ (\d+) (setup|block)$", out, re.M)
    if rc != 0:
        if started:
            index, phase = int(started[-1][0]), started[-1][1]
            where = next(b for b in blocks if b.index == index).where()
            what = f"the hidden setup of {where}" if phase == "setup" else where
        else:
            what = f"{path}: before any block"
        pytest.fail(f"{what} failed (exit {rc}):\n{err[-4000:]}", pytrace=False)
    print(f"{path}: {len(to_run)} run, {len(blocks) - len(to_run)} skipped")
    print("\n".join(line for line in out.splitlines() if line.startswith("@@") and "done" in line))
