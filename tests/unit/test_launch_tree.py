"""What `launch --workdir` would push, read from real folders: git's ignore rules (nested
.gitignore files, negation, .torchrigignore), what is never sent, links inside and outside
the tree, the size bound, and torchrig's support files."""

import os
import subprocess
from pathlib import Path

import pytest

from torchrig.errors import TorchrigError
from torchrig.launch.tree import (SUPPORT_DIR, SUPPORT_FILES, payload_tree, project_tree,
                                  with_support)
from torchrig.resources import PAYLOAD

MB = 1 << 20


def _files(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_ignore_files_follow_git(tmp_path):
    root = _files(tmp_path / "proj", {
        "train.py": "x", "pkg/__init__.py": "", "pkg/model.py": "m",
        ".gitignore": "*.log\n/data/\n!keep.log\n",
        "pkg/.gitignore": "generated/\nlocal_*.py\n/only_here.txt\n",
        "pkg/generated/a.py": "g", "pkg/local_x.py": "l", "pkg/sub/local_y.py": "l",
        "pkg/only_here.txt": "o", "pkg/sub/only_here.txt": "kept: anchored to pkg/",
        "run.log": "r", "keep.log": "k", "data/shard0": "d", "sub/data/x": "not top-level",
        ".torchrigignore": "notes/\n!weights/init.pt\n",
        "notes/a.md": "n", "weights/init.pt": "w", "weights/other.pt": "w",
        ".git/config": "c", ".venv/pyvenv.cfg": "home = /usr", ".venv/lib/x.py": "v",
        "myenv/pyvenv.cfg": "home = /usr", "pkg/__pycache__/m.cpython-311.pyc": "b",
        "ckpt.pt": "c", "outputs/run1/log": "o",
    })
    got = set(project_tree(root, 10 * MB).files)
    assert got == {"train.py", "pkg/__init__.py", "pkg/model.py", ".gitignore",
                   "pkg/.gitignore", "pkg/sub/only_here.txt", "keep.log", "sub/data/x",
                   ".torchrigignore", "weights/init.pt"}
    # the same decisions git itself makes for what it would track (git's own check-ignore)
    if subprocess.run(["git", "--version"], capture_output=True).returncode == 0:
        subprocess.run(["git", "init", "-q", str(root)], check=True)
        tracked = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard"],
                                 capture_output=True, text=True, check=True).stdout.split()
        for rel in tracked:   # git's view: ignores .gitignore only, so compare on those
            if not rel.startswith(("notes/", "weights/", ".venv/", "myenv/", "outputs/")) \
                    and rel != "ckpt.pt" and "__pycache__" not in rel:
                assert rel in got, f"git would send {rel}, torchrig does not"


def test_links_inside_are_sent_as_links_outside_refused(tmp_path):
    root = _files(tmp_path / "proj", {"train.py": "x", "src/lib.py": "l"})
    os.symlink("src/lib.py", root / "lib.py")
    os.symlink("src", root / "code")
    t = project_tree(root, MB)
    assert t.files["lib.py"].link == "src/lib.py" and t.files["code"].link == "src"
    assert "code/lib.py" not in t.files   # a linked folder is not walked twice
    (tmp_path / "secret").write_text("s")
    os.symlink("../secret", root / "up")
    os.symlink("/etc/passwd", root / "abs")
    with pytest.raises(TorchrigError) as e:
        project_tree(root, MB)
    assert "abs -> /etc/passwd" in str(e.value) and "up -> ../secret" in str(e.value)
    assert "points outside the project" in str(e.value)


def test_an_oversized_tree_is_refused_naming_its_largest_files(tmp_path):
    root = _files(tmp_path / "proj", {"train.py": "x"})
    (root / "big.bin").write_bytes(b"\0" * (3 * MB))
    (root / "mid.bin").write_bytes(b"\0" * MB)
    with pytest.raises(TorchrigError) as e:
        project_tree(root, 2 * MB)
    msg = str(e.value)
    assert "4.0 MiB to send, over the 2.0 MiB bound" in msg
    assert msg.index("big.bin (3.0 MiB)") < msg.index("mid.bin (1.0 MiB)")
    assert ".torchrigignore" in msg and "workdir_max_mb" in msg
    (root / ".torchrigignore").write_text("*.bin\n")
    assert set(project_tree(root, 2 * MB).files) == {"train.py", ".torchrigignore"}


def test_a_missing_folder_and_a_fifo(tmp_path):
    with pytest.raises(TorchrigError, match="no such folder"):
        project_tree(tmp_path / "nope", MB)
    root = _files(tmp_path / "proj", {"train.py": "x"})
    os.mkfifo(root / "pipe")
    with pytest.raises(TorchrigError, match=r"pipe \(not a regular file\)"):
        project_tree(root, MB)


def test_support_files_and_hashes(tmp_path):
    root = _files(tmp_path / "proj", {"train.py": "x"})
    t = with_support(project_tree(root, MB), PAYLOAD)
    assert {f"{SUPPORT_DIR}/{n}" for n in SUPPORT_FILES} | {"train.py"} == set(t.files)
    h = t.hash
    (root / "train.py").write_text("y")
    assert with_support(project_tree(root, MB), PAYLOAD).hash != h
    # the user's own .torchrig/ never replaces torchrig's files
    _files(root, {".torchrig/progress.py": "evil"})
    t2 = with_support(project_tree(root, MB), PAYLOAD)
    assert t2.files[f"{SUPPORT_DIR}/progress.py"].source == PAYLOAD / "progress.py"
    assert "progress.py" in payload_tree(PAYLOAD).files
