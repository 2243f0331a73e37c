"""A project's dependencies on the operator's side: where they are read from, what is refused
(naming the line), the environment's key, and the comparison of the nodes' package sets."""

import pytest

from torchrig.errors import TorchrigError
from torchrig.launch import deps
from torchrig.launch.deps import Built, Requirements


def find(root, requirements):
    """deps.find as the launch calls it: with the project's pyproject.toml read once."""
    return deps.find(root, requirements, deps.read_pyproject(root))


def test_where_requirements_come_from(tmp_path):
    assert find(tmp_path, None) is None
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "p"\ndependencies = ["six>=1.16", "attrs"]\n')
    r = find(tmp_path, None)
    assert r.lines == ("six>=1.16", "attrs") and "pyproject.toml" in r.source
    (tmp_path / "requirements.txt").write_text("# pinned\nsix==1.16.0  # why\n\nnumpy \\\n  >=1.0\n")
    r = find(tmp_path, None)
    assert r == Requirements("requirements.txt", ("six==1.16.0", "numpy >=1.0"))
    (tmp_path / "req-gpu.txt").write_text("six\n")
    assert find(tmp_path, "req-gpu.txt").lines == ("six",)
    with pytest.raises(TorchrigError, match="no such file"):
        find(tmp_path, "nope.txt")
    with pytest.raises(TorchrigError, match="inside the project"):
        find(tmp_path, "../x.txt")


def test_a_lock_file_alone_says_how_to_export_it(tmp_path):
    (tmp_path / "uv.lock").write_text("version = 1\n")
    with pytest.raises(TorchrigError, match="uv export"):
        find(tmp_path, None)


@pytest.mark.parametrize("line", ["-r other.txt", "--extra-index-url https://u:p@x/simple",
                                  "-e ../other", "--index-url=https://x/simple"])
def test_options_reaching_outside_the_file_are_refused(tmp_path, line):
    (tmp_path / "requirements.txt").write_text(f"six\n{line}\n")
    with pytest.raises(TorchrigError, match="requirements.txt line 2"):
        find(tmp_path, None)


PROJECT = """[project]
name = "My_Pkg"
dependencies = ["six>=1.16", "attrs"]
[project.optional-dependencies]
train = ["numpy>=1.0", "six>=1.16"]
eval = ["tqdm"]
all = ["my-pkg[train,eval]"]
"""


@pytest.mark.parametrize("line,extra", [
    ("-e .", []), (".", []), ("-e ./", []), ("--editable=.", []), ("-e .[train]", ["numpy>=1.0"]),
    (".[train, eval]", ["numpy>=1.0", "tqdm"]), ("-e .[all]", ["numpy>=1.0", "tqdm"])])
def test_a_line_installing_the_project_itself_stands_for_its_dependencies(tmp_path, line, extra):
    """`-e .` in requirements.txt: the project is imported from its folder, not installed; its
    dependencies (and its extras', an extra naming the project itself included) are read from
    pyproject.toml, in order, once each."""
    (tmp_path / "pyproject.toml").write_text(PROJECT)
    (tmp_path / "requirements.txt").write_text(f"torchmetrics\n{line}  # the project\n")
    r = find(tmp_path, None)
    assert r.lines == ("torchmetrics", "six>=1.16", "attrs", *extra), r


@pytest.mark.parametrize("doc,match", [
    (None, r"requirements.txt line 1: '-e \.' installs the project itself; torchrig reads its "
           r"dependencies from pyproject.toml's \[project\] table, which .* lacks: list its "
           r"dependencies in this file instead"),
    ('[project]\nname = "p"\ndynamic = ["dependencies"]\n', r"dynamic = \[\"dependencies\"\]"),
    ('[project]\nname = "p"\n[project.optional-dependencies]\ngpu = []\n',
     r"no optional dependencies 'train' \(it has: gpu\)"),
])
def test_a_project_line_whose_dependencies_cannot_be_read_says_what_to_do(tmp_path, doc, match):
    if doc is not None:
        (tmp_path / "pyproject.toml").write_text(doc)
    (tmp_path / "requirements.txt").write_text("-e .[train]\n" if "gpu" in (doc or "") else "-e .\n")
    with pytest.raises(TorchrigError, match=match):
        find(tmp_path, None)


@pytest.mark.parametrize("via", ["pyproject", "-e ."])
def test_a_pip_option_among_pyprojects_dependencies_is_refused(tmp_path, via):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "p"\ndependencies = ["six", "--extra-index-url https://u:p@x/simple"]\n')
    if via == "-e .":
        (tmp_path / "requirements.txt").write_text("-e .\n")
    with pytest.raises(TorchrigError, match=r"dependency '--extra-index-url' is a pip option") as e:
        find(tmp_path, None)
    assert "u:p" not in str(e.value)


def test_a_requirements_file_elsewhere_in_the_project_reads_dot_as_its_top(tmp_path):
    (tmp_path / "pyproject.toml").write_text(PROJECT)
    (tmp_path / "reqs").mkdir()
    (tmp_path / "reqs" / "gpu.txt").write_text("-e .[eval]\n")
    assert find(tmp_path, "reqs/gpu.txt").lines == ("six>=1.16", "attrs", "tqdm")


@pytest.mark.parametrize("line,refused", [
    ("torch==2.5.0", True), ("torch>=2.0", False), ("torch", False), ("Torch<2.13", True),
    ("torch==2.13.0 --hash=sha256:00", False), ("torch @ https://x/torch.whl", True),
    ("torchvision", False), ("six", False)])
def test_a_line_that_would_replace_torch_is_refused_by_name(line, refused):
    reqs = Requirements("requirements.txt", ("six", line))
    if refused:
        with pytest.raises(TorchrigError) as e:
            deps.check_torch(reqs, "2.13.0", allow=False)
        assert repr(line) in str(e.value) and "--allow-torch-change" in str(e.value)
        deps.check_torch(reqs, "2.13.0", allow=True)
    else:
        deps.check_torch(reqs, "2.13.0", allow=False)


def test_the_environment_key():
    r = Requirements("requirements.txt", ("six==1.16.0",))
    h = deps.env_hash(r, "2.13.0", "/opt/torchrig/venv", "https://idx/simple", False)
    assert h == deps.env_hash(Requirements("other", r.lines), "2.13.0", "/opt/torchrig/venv",
                              "https://idx/simple", False)
    for changed in [(Requirements("r", ("six==1.15.0",)), "2.13.0", "/opt/torchrig/venv", "https://idx/simple", False),
                    (r, "2.12.0", "/opt/torchrig/venv", "https://idx/simple", False),
                    (r, "2.13.0", "/opt/v2", "https://idx/simple", False),
                    (r, "2.13.0", "/opt/torchrig/venv", None, False),
                    (r, "2.13.0", "/opt/torchrig/venv", "https://idx/simple", True)]:
        assert deps.env_hash(*changed) != h


def test_the_credentials_go_to_a_netrc_never_a_command_line():
    text = deps.ensure_script(Requirements("r", ("six",)), "/opt/torchrig", "0123456789abcdef", "/opt/torchrig/venv",
                              "https://me:s3cret@idx.example/simple", None, False)
    assert "s3cret" not in text and "--index-url https://idx.example/simple" in text
    assert "NETRC=" in text


def test_parse_and_compare_package_sets():
    out = "built\nsix==1.16.0\ntorch==2.13.0\n--- recorded\nsix==1.16.0\ntorch==2.13.0\n"
    state, now, rec = deps.parse_ensure(out)
    assert state == "built" and now == rec == {"six": "1.16.0", "torch": "2.13.0"}
    same = Built("cached", now, rec, 1.0)
    assert deps.differences({"gpu1": same, "gpu4": same}) == []
    by_hand = Built("cached", {"six": "1.15.0", "torch": "2.13.0"}, rec, 1.0)
    diff = deps.differences({"gpu1": same, "gpu4": by_hand})
    assert diff == ["gpu4: changed since it was built: six 1.16.0 -> 1.15.0",
                    "six: gpu1 1.16.0, gpu4 1.15.0"]
    extra = Built("cached", {**now, "attrs": "23.1"}, {**rec, "attrs": "23.1"}, 1.0)
    assert deps.differences({"gpu1": same, "gpu4": extra}) == ["attrs: gpu1 absent, gpu4 23.1"]
    with pytest.raises(TorchrigError):
        deps.parse_ensure("Traceback ...")


@pytest.mark.parametrize("names,allow,code", [
    (["six"], False, 0), (["six", "torch"], False, 3), (["nvidia-nccl-cu12"], False, 3),
    (["Triton"], False, 3), (["torch"], True, 0), (["torchvision"], False, 0)])
def test_the_nodes_refuse_a_dry_run_that_would_install_the_provisioned_stack(tmp_path, names, allow, code):
    """onhost/deps/protected.py over pip's --report JSON (what a dependency's dependency
    would install: the line check above cannot see it)."""
    import json
    import subprocess
    import sys
    from torchrig.onhost import script
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"version": "1", "install": [
        {"metadata": {"name": n, "version": "9.9"}, "requested": False} for n in names]}))
    r = subprocess.run([sys.executable, "-I", "-c", script("deps/protected.py"), str(report),
                        "1" if allow else "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == code, r.stderr
    if code:
        assert r.stderr.startswith("error: the requirements would install ") and "9.9" in r.stderr


# ---- requires-python: the project against the nodes' Python, before anything is sent --------

def test_requires_python_is_read_and_checked_as_a_specifier():
    assert deps.requires_python(None) is None and deps.requires_python({"tool": {}}) is None
    assert deps.requires_python({"project": {"requires-python": ">=3.10, <3.14"}}) == ">=3.10, <3.14"
    with pytest.raises(TorchrigError, match=r"requires-python 'python3' is not a version specifier"):
        deps.requires_python({"project": {"requires-python": "python3"}})


def test_a_project_the_nodes_python_cannot_run_is_refused_before_anything_starts():
    from torchrig.launch.run import judge_versions
    from torchrig.verify.evaluate import HostVerdict
    from torchrig.verify.run import VerifyReport

    def rep(py):
        vs = [HostVerdict(h, versions={"python": py, "torch": "2.13.0"}) for h in ("gpu1", "gpu4")]
        return VerifyReport(vs, also={h: {"run": {"busy": {"rc": 0, "out": "", "err": ""}}}
                                      for h in ("gpu1", "gpu4")})
    hosts = [type("H", (), {"name": n})() for n in ("gpu1", "gpu4")]
    for spec in (None, ">=3.10", ">=3.11,<3.13"):
        assert judge_versions(rep("3.11.2"), hosts, "j", spec) == {"gpu1": None, "gpu4": None}
    with pytest.raises(TorchrigError, match=r"^nothing started: pyproject.toml says requires-python "
                                            r"'>=3.12', and the torch venv runs Python 3.11.2 on "
                                            r"gpu1, gpu4 \(the distribution's python3: .*\); relax"):
        judge_versions(rep("3.11.2"), hosts, "j", ">=3.12")
    deps.check_python(">=3.12", {"gpu1": None})  # unknown (an old probe): pip decides on the node
