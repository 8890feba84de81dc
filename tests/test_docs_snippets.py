"""Every code block of README.md and docs/*.md runs as written (the rule: docs/snippets.md), and
every relative link of those pages points at a file (and heading) that exists.

```python and ```bash blocks run unless the line before the fence is a snippet comment:
``<!-- snippet: skip (why) -->`` (never run), or tags among ``gpu`` (under the gpu mark),
``megatron`` (megatron-core; on CPU run after the test-only shims of tests/megatron_cpu.py) and
``torchrun N`` (the block is a whole script, run on N ranks). Python blocks run in one process
that imports torch once and forks a fresh child per block (fresh namespace, no state shared
between blocks); a ``torchrun 1`` script runs there too, with torchrun's variables for one rank."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_LANGS = ("python", "bash")
TAG = re.compile(r"^<!--\s*snippet:\s*(.*?)\s*-->$")
FENCE = re.compile(r"^```(\S*)\s*$")
CUDA = torch.cuda.is_available()
BLOCK_TIMEOUT_S = 180


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the first code line
    lang: str
    tags: tuple[str, ...]
    skip_reason: str | None
    nproc: int  # torchrun ranks; 0: not a torchrun script
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _parse_tags(text: str, where: str) -> tuple[tuple[str, ...], str | None, int]:
    skip = re.fullmatch(r"skip\s*\((.+)\)", text)
    if skip:
        return ("skip",), skip.group(1).strip(), 0
    words, tags, nproc = text.split(), [], 0
    while words:
        word = words.pop(0)
        if word == "torchrun":
            if not words or not words[0].isdigit() or int(words[0]) < 1:
                raise ValueError(f"{where}: 'torchrun' needs a rank count >= 1, got {text!r}")
            nproc = int(words.pop(0))
        elif word not in ("gpu", "megatron"):
            raise ValueError(f"{where}: unknown snippet tag {word!r} in {text!r} (expected skip (why), gpu, "
                             "megatron, torchrun N)")
        tags.append(word)
    return tuple(tags), None, nproc


def parse(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, lang = i, match.group(1)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{page.name}:{start + 1}: unclosed code block")
        prev = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        tag = TAG.match(prev)
        where = f"{page.relative_to(ROOT)}:{start + 1}"
        tags, reason, nproc = _parse_tags(tag.group(1), where) if tag else ((), None, 0)
        blocks.append(Block(page, start + 2, lang, tags, reason, nproc, "\n".join(lines[start + 1:end]) + "\n"))
        i = end + 1
    return blocks


BLOCKS = [b for page in PAGES for b in parse(page)]
RUNNABLE = [b for b in BLOCKS if b.lang in RUN_LANGS and b.skip_reason is None]


def _marks(block: Block) -> list:
    return [pytest.mark.gpu] if "gpu" in block.tags else []


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # the console script of this interpreter's environment (as after `source .venv/bin/activate`)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def test_the_pages_follow_the_rule():
    """Every block is python, bash or another language that is not run (text); every skip says why;
    tags parse (done at import); the runnable set is not empty, so the tests below test something."""
    for block in BLOCKS:
        assert block.lang, f"{block.where}: a code block needs a language (python, bash, text)"
        if block.lang not in RUN_LANGS:
            assert not block.tags, f"{block.where}: tags on a {block.lang} block, which is never run"
        if block.nproc:
            assert block.lang == "python", f"{block.where}: torchrun runs python blocks only"
    langs = {b.lang for b in RUNNABLE}
    assert {"python", "bash"} <= langs, langs
    assert any(b.nproc for b in RUNNABLE), "no torchrun block"


# --- python blocks: one process imports torch once and forks a child per block -------------------
_RUNNER = textwrap.dedent("""
    import json, os, signal, socket, sys, traceback
    import torch, moe_dispatch  # noqa: F401  (imported once, before any fork)
    blocks, logs = json.load(sys.stdin), sys.argv[1]
    if any("megatron" in b["code"] for b in blocks):
        import megatron.core  # noqa: F401
    results = {}
    for i, b in enumerate(blocks):
        sys.stdout.flush(); sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            log = os.open(os.path.join(logs, f"{i}.log"), os.O_WRONLY | os.O_CREAT)
            os.dup2(log, 1); os.dup2(log, 2)
            signal.alarm(b["timeout"])
            try:
                if b["one_rank"]:  # what torchrun sets for a single rank
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", 0))
                        port = s.getsockname()[1]
                    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                if b["shims"]:
                    from tests.megatron_cpu import apply_cpu_shims
                    apply_cpu_shims(prepare=False)
                exec(compile(b["code"], b["where"], "exec"), {"__name__": "__main__"})
                code = 0
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        with open(os.path.join(logs, f"{i}.log")) as f:
            results[b["where"]] = [status == 0, f.read()[-6000:]]
    print(json.dumps(results))
""")


def _in_runner(block: Block) -> bool:
    """Plain python blocks, and torchrun scripts of one rank (run with torchrun's variables)."""
    return block.lang == "python" and block.nproc in (0, 1)


def _run_python_blocks(blocks: list[Block], logs: Path) -> dict:
    payload = [dict(code=b.code, where=b.where, timeout=BLOCK_TIMEOUT_S, one_rank=b.nproc == 1,
                    shims="megatron" in b.tags and not CUDA) for b in blocks]
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(logs)], input=json.dumps(payload), capture_output=True,
                          text=True, cwd=ROOT, env=_env(), timeout=BLOCK_TIMEOUT_S * max(1, len(blocks)))
    assert proc.returncode == 0, proc.stderr[-8000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory) -> dict:
    """Every CPU python block of every page, run once: {where: [passed, output]}."""
    blocks = [b for b in RUNNABLE if _in_runner(b) and "gpu" not in b.tags]
    return _run_python_blocks(blocks, tmp_path_factory.mktemp("snippets"))


def _pages_with(gpu: bool) -> list:
    pages = sorted({b.page for b in RUNNABLE if _in_runner(b) and ("gpu" in b.tags) == gpu})
    return [pytest.param(p, id=p.name, marks=[pytest.mark.gpu] if gpu else []) for p in pages]


def _assert_passed(results: dict, page: Path, gpu: bool) -> None:
    mine = [b for b in RUNNABLE if b.page == page and _in_runner(b) and ("gpu" in b.tags) == gpu]
    failed = {b.where: results[b.where][1] for b in mine if not results[b.where][0]}
    assert not failed, "\n\n".join(f"{where}:\n{out}" for where, out in failed.items())


@pytest.mark.parametrize("page", _pages_with(gpu=False))
def test_python_blocks(page, cpu_results):
    _assert_passed(cpu_results, page, gpu=False)


@pytest.mark.parametrize("page", _pages_with(gpu=True))
def test_python_blocks_gpu(page, tmp_path):
    blocks = [b for b in RUNNABLE if b.page == page and _in_runner(b) and "gpu" in b.tags]
    _assert_passed(_run_python_blocks(blocks, tmp_path), page, gpu=True)


# --- whole scripts under torchrun -----------------------------------------------------------------
@pytest.mark.parametrize("block", [pytest.param(b, id=b.where, marks=_marks(b)) for b in RUNNABLE if b.nproc > 1])
def test_torchrun_blocks(block, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(block.code)
    target = script
    if "megatron" in block.tags and not CUDA:  # the test-only CPU shims, then the block as written
        target = tmp_path / "with_cpu_shims.py"
        target.write_text("import runpy, sys\nfrom tests.megatron_cpu import apply_cpu_shims\n"
                          "apply_cpu_shims(prepare=False)\n"
                          f"runpy.run_path({str(script)!r}, run_name='__main__')\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(block.nproc),
           str(target)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=BLOCK_TIMEOUT_S)
    assert proc.returncode == 0, f"{block.where}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


# --- bash blocks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [pytest.param(b, id=b.where, marks=_marks(b)) for b in RUNNABLE
                                   if b.lang == "bash"])
def test_bash_blocks(block):
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], capture_output=True, text=True, cwd=ROOT,
                          env=_env(), timeout=BLOCK_TIMEOUT_S)
    assert proc.returncode == 0, f"{block.where}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


# --- links ----------------------------------------------------------------------------------------
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


# Files another branch adds (the lead merges it); drop an entry once it has landed.
PENDING: set[str] = set()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    pending = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() and dest.relative_to(ROOT).as_posix() in PENDING:
            pending.append(target)
            continue
        assert dest.exists(), f"{page.name}: link {target!r}: no {dest}"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page.name}: link {target!r}: no heading #{anchor} in {dest.name}"
    if pending:
        pytest.xfail(f"{page.name}: {pending} not on this branch yet (PENDING)")
