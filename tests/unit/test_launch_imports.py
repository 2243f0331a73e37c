"""Where a user project's packages import from (launch/imports.py): the folders its packaging
metadata names, or PyPA's src layout, go on the job's PYTHONPATH after the project's top; a
project without packaging metadata gets nothing more (its folders would shadow installed
packages)."""

import pytest

from torchrig.errors import TorchrigError
from torchrig.launch.imports import import_roots

SRC_PKG = ["src/mypkg/__init__.py", "src/mypkg/train.py", "README.md"]


@pytest.mark.parametrize("marker", ["pyproject.toml", "setup.cfg", "setup.py"])
def test_a_packaged_src_layout_imports_from_src(marker):
    assert import_roots([marker, *SRC_PKG]) == (("src",), "the src layout")
    assert import_roots([marker, "src/tool.py"]) == (("src",), "the src layout")  # one module


@pytest.mark.parametrize("files", [
    SRC_PKG,                                                   # no packaging metadata
    ["pyproject.toml", "src/__init__.py", *SRC_PKG],           # src is itself a package: src.x
    ["pyproject.toml", "src/data/shard.bin", "src/README.md"],  # nothing importable in it
    ["pyproject.toml", "mypkg/__init__.py", "train.py"],       # a flat layout
])
def test_nothing_more_where_the_project_is_not_a_src_layout(files):
    assert import_roots(files)[0] == ()


TOML = [
    ({"tool": {"setuptools": {"package-dir": {"": "lib"}}}}, "[tool.setuptools] package-dir"),
    ({"tool": {"setuptools": {"packages": {"find": {"where": ["lib"]}}}}},
     "[tool.setuptools.packages.find] where"),
    ({"tool": {"setuptools": {"packages": {"find": {"where": "lib"}}}}},
     "[tool.setuptools.packages.find] where"),
    ({"tool": {"poetry": {"packages": [{"include": "mypkg", "from": "lib"}]}}}, "[tool.poetry] packages"),
    ({"tool": {"hatch": {"build": {"targets": {"wheel": {"packages": ["lib/mypkg"]}}}}}},
     "[tool.hatch.build.targets.wheel] packages"),
    ({"tool": {"pdm": {"build": {"package-dir": "lib"}}}}, "[tool.pdm.build] package-dir"),
    ({"tool": {"uv": {"build-backend": {"module-root": "./lib/"}}}}, "[tool.uv.build-backend] module-root"),
]


@pytest.mark.parametrize("doc,where", TOML)
def test_the_folder_pyproject_names(doc, where):
    files = ["pyproject.toml", "lib/mypkg/__init__.py", "src/other/__init__.py"]
    assert import_roots(files, doc) == (("lib",), f"pyproject.toml {where}")


@pytest.mark.parametrize("cfg", ["[options]\npackage_dir =\n    =lib\n",
                                 "[options]\npackage_dir = =lib\n",
                                 "[options.packages.find]\nwhere = lib\n"])
def test_the_folder_setup_cfg_names(cfg):
    got, where = import_roots(["setup.cfg", "lib/mypkg/__init__.py"], None, cfg)
    assert got == ("lib",) and where.startswith("setup.cfg [options")


def test_the_top_a_folder_not_sent_and_malformed_metadata_add_nothing():
    files = ["pyproject.toml", "mypkg/__init__.py"]
    assert import_roots(files, {"tool": {"setuptools": {"package-dir": {"": "."}}}})[0] == ()
    assert import_roots(files, {"tool": {"poetry": {"packages": [{"include": "mypkg"}]}}})[0] == ()
    assert import_roots(files, {"tool": {"hatch": {"build": {"targets": {"wheel": {
        "packages": ["mypkg"]}}}}}})[0] == ()
    # named, but not among the files sent (missing, or .gitignore'd)
    assert import_roots(files, {"tool": {"setuptools": {"package-dir": {"": "lib"}}}})[0] == ()
    for doc in ({"tool": "x"}, {"tool": {"setuptools": {"packages": ["mypkg"]}}},
                {"tool": {"setuptools": {"packages": {"find": {"where": 3}}}}},
                {"tool": {"poetry": {"packages": "mypkg"}}}):
        assert import_roots(files, doc)[0] == ()
    assert import_roots(["setup.cfg", *SRC_PKG], None, "not [an ini")[0] == ("src",)


@pytest.mark.parametrize("folder", ["../outside", "lib/../../x", "a:b", "lib dir", "/abs/lib"])
def test_a_folder_that_cannot_go_on_pythonpath_is_refused_by_name(folder):
    doc = {"tool": {"setuptools": {"package-dir": {"": folder}}}}
    with pytest.raises(TorchrigError, match=r"pyproject.toml \[tool.setuptools\] package-dir: "
                                            r"package folder .* cannot go on the job's PYTHONPATH"):
        import_roots(["pyproject.toml", "lib/m.py"], doc)


def test_the_launch_reads_it_from_the_project(tmp_path):
    """stage.source: the files as sent (.gitignore honoured) and the project's pyproject.toml
    (its requires-python too)."""
    from types import SimpleNamespace as NS

    from torchrig.launch import stage
    from torchrig.launch.run import LaunchOptions
    from torchrig.settings import Settings
    p = tmp_path / "proj"
    (p / "src" / "mypkg").mkdir(parents=True)
    (p / "src" / "mypkg" / "__init__.py").write_text("")
    (p / "train.py").write_text("import mypkg\n")
    (p / "pyproject.toml").write_text('[project]\nname = "mypkg"\nversion = "0"\n'
                                      'requires-python = ">=3.10"\n')
    host = NS(settings=Settings())
    got = stage.source(LaunchOptions(job="j", workdir=str(p)), host)
    assert (got.paths, got.paths_from) == (("src",), "the src layout")
    assert got.requires_python == ">=3.10"   # checked against the nodes' Python at the gate
    (p / ".gitignore").write_text("src/\n")
    assert stage.source(LaunchOptions(job="j", workdir=str(p)), host).paths == ()
    (p / "pyproject.toml").write_text("[tool.setuptools\n")
    with pytest.raises(TorchrigError, match="pyproject.toml: not valid TOML"):
        stage.source(LaunchOptions(job="j", workdir=str(p)), host)


def test_a_module_missing_from_the_projects_own_package_is_refused_by_name():
    from torchrig.launch.imports import check_module
    files = ["pyproject.toml", "src/trainer/__init__.py", "src/trainer/run.py",
             "src/trainer/cli/__main__.py", "tools/__init__.py", "tools/prep.py"]
    for ok in ("trainer.run", "trainer.cli", "tools.prep", "lightning.pytorch.cli", "train"):
        check_module(ok, files, ("src",))
    with pytest.raises(TorchrigError, match=r"^--module trainer.rn: the project's package src/trainer/ "
                                            r"has no src/trainer/rn.py \(or src/trainer/rn/__main__.py\)$"):
        check_module("trainer.rn", files, ("src",))
    with pytest.raises(TorchrigError, match=r"package tools/ has no tools/prep2.py"):
        check_module("tools.prep2", files, ("src",))
    check_module("trainer.rn", files, ())   # src not on the path: not the project's package
    # the top wins, as on the path: a top-level trainer/ is the one Python imports
    with pytest.raises(TorchrigError, match=r"package trainer/ has no trainer/run.py"):
        check_module("trainer.run", files + ["trainer/__init__.py"], ("src",))
