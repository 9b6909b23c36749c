"""scripts/check_structure.py, the rules `make lint` holds the package to."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "check_structure", ROOT / "scripts/check_structure.py"
)
check_structure = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_structure)


def test_the_package_cites_no_issue_of_its_own_but_may_cite_another_projects(tmp_path):
    package = tmp_path / "horovod_powersgd"
    (package / "bench").mkdir(parents=True)
    (package / "tuner.py").write_text('"""28 steps (the review of issue 46 saw 23-28)."""\n')
    (package / "bench" / "published.py").write_text(
        'SOURCES = ["PyTorch issue 74148", "Horovod issue 3881", "issues 54 and 57"]\n'
    )
    (package / "linalg.py").write_text("# Issue 7: TF32\nx = 1  # tissue 3 is not one\n")
    found = check_structure.history(package)
    assert [line.split(" cites")[0] for line in found] == [
        "horovod_powersgd/bench/published.py:1",
        "horovod_powersgd/linalg.py:1",
        "horovod_powersgd/tuner.py:1",
    ], found
    assert check_structure.history() == []  # the package itself, today


def test_no_module_reaches_into_another_modules_private_members(tmp_path):
    package = tmp_path / "horovod_powersgd"
    package.mkdir()
    (package / "tuner.py").write_text(
        "import torch\n"
        "class Tuner:\n"
        "    def __init__(self):\n"
        "        self._window = []\n"
        "    def end_step(self, opt, other):\n"
        "        opt._reducer.refresh()\n"  # the optimizer's private part: refused
        "        other._window.clear()\n"  # its own class's member on another instance
        "        torch._foreach_norm([])\n"  # a private API of a module from outside
        "        self.comm._counters = 0\n"  # a public part's private member: refused
    )
    found = check_structure.private_reach(package)
    assert [line.split(" reaches")[0] for line in found] == [
        "horovod_powersgd/tuner.py:6",
        "horovod_powersgd/tuner.py:9",
    ], found
    assert check_structure.private_reach() == []  # the package itself, today


def test_floors_put_each_module_one_above_the_highest_it_imports(tmp_path):
    package = tmp_path / "horovod_powersgd"
    (package / "bench").mkdir(parents=True)
    (package / "a.py").write_text("import torch\n")
    (package / "b.py").write_text("from .a import x\n")
    (package / "c.py").write_text("from . import b\nfrom .a import y\n")
    (package / "__init__.py").write_text("from .b import z\n")
    (package / "bench" / "run.py").write_text(
        "import horovod_powersgd as hps\nfrom ..c import w\nfrom . import other\n"
    )
    floors = check_structure.floors(package)
    assert floors == {"a": 1, "b": 2, "c": 3, "__init__": 3, "bench/": 4}, floors
