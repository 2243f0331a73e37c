"""Every command the docs show names a real task, real flags and real make targets, and every
relative link in them leads somewhere. The docs are README.md and docs/*.md; the commands
are checked against the task collection itself (`torchrig` and `invoke` read the same one),
never by running them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from torchrig.cli.tasks import ns

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Invoke's own flags, before the task name (and -h/--help after it: the task's help)
CORE_FLAGS = {"--version", "-V", "--list", "-l", "--print-completion-script", "--complete",
              "--debug", "-d", "-f", "--config", "--help", "-h"}
CORE_WITH_VALUE = {"-f", "--config", "--print-completion-script"}
FLAG = re.compile(r"-{1,2}[A-Za-z][\w-]*")
PLACEHOLDER = re.compile(r"<[^>]*>|[A-Z][A-Z_]*|\.\.\.")
PREFIXES = re.compile(r"^(?:\$ +)?(?:sudo +)?(?:time +)?(?:[A-Z_]+=\S* +)*")
FENCE = re.compile(r"^\s*(```|~~~)")


def task_flags() -> dict[str, set[str]]:
    """{task name (dotted for sub-collections): every flag it takes, as written}."""
    out = {}
    for name in ns.task_names:
        flags = set()
        for arg in ns[name].get_arguments():
            for n in arg.names:
                flags.add(("-" if len(n) == 1 else "--") + n)
            if arg.kind is bool:
                flags.add("--no-" + arg.names[0])  # Invoke's negation of a flag
        out[name] = flags
    return out


def make_targets(makefile: Path) -> set[str]:
    targets = set()
    for line in makefile.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_./$()-]+(?:\s+[A-Za-z0-9_./$()-]+)*)\s*:(?!=)", line)
        if m and not line.startswith((".", "\t")):
            targets.update(m[1].split())
    return targets


def _blocks(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(lines inside fenced code blocks, lines outside them), each with its line number."""
    inside, outside, fenced = [], [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        (inside if fenced else outside).append((n, line))
    return inside, outside


def commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) for every `torchrig`, `invoke` and `make` command in a page:
    each line of a fenced block (after an optional `$ `, a `\\` continuation joined), and
    each inline code span."""
    inside, outside = _blocks(text)
    found, held = [], None
    for n, line in inside:
        if held:
            line = held[1] + " " + line.strip()
            n = held[0]
        if line.rstrip().endswith("\\"):
            held = (n, line.rstrip()[:-1])
            continue
        held = None
        found.append((n, line.strip()))
    prose = "\n".join(line for _, line in outside)
    numbers = [n for n, _ in outside]
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose):
        found.append((numbers[prose.count("\n", 0, m.start())], " ".join(m[1].split())))
    # `source <(torchrig --print-completion-script bash)`: the command inside too
    return found + [(n, c) for n, line in found
                    for c in re.findall(r"[<$]\(((?:torchrig|invoke) [^)]*)\)", line)]


def _words(command: str) -> list[str] | None:
    try:
        return shlex.split(command, comments=True)
    except ValueError:
        return None  # not a shell line (prose in a code span)


def problems_in(text: str, where: str, tasks: dict[str, set[str]], targets: set[str]) -> list[str]:
    """What is wrong with one page's commands: unknown tasks, flags and make targets."""
    every_flag = set().union(*tasks.values())
    bad = []
    for n, command in commands(text):
        command = PREFIXES.sub("", command)
        words = _words(command)
        if not words:
            continue
        head, rest = words[0], words[1:]
        at = f"{where}:{n}: {command}"
        if head == "make":
            bad += [f"{at}: no make target {w!r}" for w in rest
                    if "=" not in w and not w.startswith("-") and w not in targets]
            continue
        if head in tasks and any(FLAG.fullmatch(w.strip("[]")) for w in rest):
            task, args = head, rest  # `status --watch N` in prose: a task and its flags
        elif head in ("torchrig", "invoke") or head.endswith("/invoke"):
            task, args = None, list(rest)
            while args and args[0].startswith("-"):
                flag = args.pop(0).split("=", 1)[0]
                if flag not in CORE_FLAGS:
                    bad.append(f"{at}: {flag} is not a flag of the command itself")
                elif flag in CORE_WITH_VALUE and args and "=" not in flag:
                    args.pop(0)
            if not args:
                continue
            task, args = args[0], args[1:]
            if PLACEHOLDER.fullmatch(task):
                task = None  # `torchrig <task> -h`: any task's flags will do
            elif task not in tasks:
                bad.append(f"{at}: no task {task!r}")
                continue
        else:
            continue
        allowed = (tasks[task] if task else every_flag) | {"-h", "--help"}
        for w in args:
            flag = w.strip("[]").split("=", 1)[0]
            if FLAG.fullmatch(flag) and flag not in allowed:
                bad.append(f"{at}: {flag} is not a flag of {task or 'any task'}")
    return bad


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    _, outside = _blocks(text)
    seen: dict[str, int] = {}
    out = set()
    for _, line in outside:
        m = re.match(r"^#{1,6} +(.*?)#*\s*$", line)
        if m:
            s = slug(m[1])
            k = seen.get(s, 0)
            seen[s] = k + 1
            out.add(s if k == 0 else f"{s}-{k}")
    return out


def broken_links(path: Path, text: str) -> list[str]:
    _, outside = _blocks(text)
    prose = "\n".join(line for _, line in outside)
    prose = re.sub(r"`[^`]*`", "", prose)  # a link in a code span is text
    bad = []
    for m in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose):
        target = m[1]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve()
        if file and not dest.exists():
            bad.append(f"{path.name}: {target}: no such file")
        elif anchor and (not file or dest.suffix == ".md") and anchor not in anchors(
                dest.read_text() if file else text):
            bad.append(f"{path.name}: {target}: no heading #{anchor} in {dest.name}")
    return bad


def test_every_command_in_the_docs_names_a_real_task_flag_and_make_target():
    tasks, targets = task_flags(), make_targets(REPO / "Makefile")
    bad, seen = [], 0
    for path in DOCS:
        text = path.read_text()
        seen += len(commands(text))
        bad += problems_in(text, path.name, tasks, targets)
    assert seen > 100  # the docs' commands were read
    assert bad == []


def test_every_relative_link_in_the_docs_leads_to_a_file_and_heading():
    bad = []
    for path in DOCS:
        bad += broken_links(path, path.read_text())
    assert bad == []


@pytest.mark.parametrize("line,complaint", [
    ("torchrig provision --no-such-flag", "--no-such-flag is not a flag of provision"),
    ("$ invoke logs -f --job x -x", "-x is not a flag of logs"),
    ("torchrig provison -H gpu1", "no task 'provison'"),
    ("torchrig --verbose provision", "--verbose is not a flag of the command itself"),
    (".venv/bin/invoke testbed.up --host gpu1", "--host is not a flag of testbed.up"),
    ("make demo tests", "no make target 'tests'"),
    ("source <(torchrig --print-completion bash)", "--print-completion is not a flag of the command itself"),
])
def test_a_wrong_command_is_found(line, complaint):
    tasks, targets = task_flags(), make_targets(REPO / "Makefile")
    for text in (f"```\n{line}\n```\n", f"see `{line}` here\n"):
        bad = problems_in(text, "x.md", tasks, targets)
        assert bad and bad[0].endswith(complaint), bad


def test_right_commands_pass():
    tasks, targets = task_flags(), make_targets(REPO / "Makefile")
    text = ("```\n$ torchrig -f my.yaml logs -H gpu1 --job a -f  # comment --nope\n"
            "torchrig launch --nodes 2 --args \"--preset gpt2 --bogus\" \\\n  --job a\n"
            "source <(torchrig --print-completion-script zsh)\nmake test\n```\n"
            "`torchrig <task> -h`, `status --watch N`, `torchrig tensorboard [--port 6006]`\n")
    assert problems_in(text, "x.md", tasks, targets) == []


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## The `x` part (y)\n")
    page = tmp_path / "b.md"
    text = ("[ok](a.md#the-x-part-y) [ok](#here) [web](https://example.org/x) `[no](z.md)`\n"
            "# Here\n[bad](a.md#nope) ![bad](missing.png)\n")
    assert broken_links(page, text) == ["b.md: a.md#nope: no heading #nope in a.md",
                                        "b.md: missing.png: no such file"]
