"""Packaging and start-up: one `icml` namespace in the wheel, every method folder registered
and importable without torch, and help that never imports torch."""
from __future__ import annotations

import importlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, invoke, run_cli
from icml.cli import registry


def method_folders() -> list[str]:
    return sorted(p.name for p in (REPO / "methods").iterdir()
                  if p.is_dir() and (p / "__init__.py").exists() and not p.name.startswith("_"))


def test_every_method_folder_is_registered():
    registered = {value.rsplit(".", 1)[-1] for value in registry.METHODS.values()}
    assert set(method_folders()) == registered
    for name, package in registry.METHODS.items():
        method = importlib.import_module(package).METHOD
        assert method.name == name and method.package == package
        assert name.replace("-", "_") == package.rsplit(".", 1)[-1]


def test_declarations_and_help_import_no_torch():
    code = ("import sys\n"
            "from icml.cli import registry\n"
            "from icml.cli.main import main\n"
            "[registry.get(n) for n in registry.METHODS]\n"
            "for argv in (['--help'], ['list', '--json'], *[[n, '--help'] for n in registry.METHODS],"
            " *[[n, 'train', '--help'] for n in registry.METHODS]):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "heavy = [m for m in ('torch', 'numpy', 'transformers', 'diffusers', 'torch_geometric', 'matplotlib', 'pandas')"
            " if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_listing_methods_imports_no_config_module():
    """`icml --help` and `icml list` read every declaration, and a declaration names its config module
    without importing it: importing `icml.methods.<m>` brings in no other icml module than cli/method.py,
    and listing all methods imports no `icml.methods.*.config` (their dataclasses cost ≈ 0.2 s together)."""
    code = ("import sys\n"
            "import icml.methods\n"
            "from icml.cli import registry\n"
            "for name, package in registry.METHODS.items():\n"
            "    before = set(sys.modules)\n"
            "    __import__(package)\n"
            "    new = {m for m in set(sys.modules) - before if m.startswith('icml.')} - {package}\n"
            "    assert not new, (name, sorted(new))\n"
            "from icml.cli.main import main\n"
            "for argv in (['--help'], ['list'], ['list', '--json']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "configs = sorted(m for m in sys.modules if m.startswith('icml.methods.') and m.endswith('.config'))\n"
            "assert not configs, configs\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]


def test_declarations_resolve_their_config_module():
    """What a declaration names in its config module is what callers get: the root config class, the
    config module's preset / validate / check_inputs, and the variants as a tuple of names."""
    for name in registry.METHODS:
        method = registry.get(name)
        module = importlib.import_module(method.config_module)
        assert method.config_module == f"{method.package}.config"
        assert isinstance(method.config, type) and method.config.__module__ == module.__name__, name
        assert method.preset is module.preset and isinstance(method.preset("smoke"), method.config), name
        assert method.validate is getattr(module, "validate", None), name
        assert method.check_inputs is getattr(module, "check_inputs", None), name
        assert method.variants and all(isinstance(v, str) for v in method.variants), (name, method.variants)


def test_help_version_and_list():
    result = run_cli(["--help"])
    assert result.returncode == 0
    for name in registry.METHODS:
        assert name in result.stdout
    version = run_cli(["--version"])
    assert version.returncode == 0 and version.stdout.startswith("icml ")
    listing = run_cli(["list", "--json"])
    import json

    doc = json.loads(listing.stdout)
    names = [m["name"] for m in doc["methods"]]
    assert names == list(registry.METHODS)
    assert all(m["arxiv"] and m["title"] and m["status"] for m in doc["methods"])
    for name in registry.METHODS:  # in-process: the entry point's own start-up is checked above
        sub = invoke(name, "--help")
        assert sub.code == 0
        assert all(verb in sub.out for verb in ("train", "eval", "report"))
        train = invoke(name, "train", "--help")
        for option in ("--preset", "--seed", "--device", "--runs-dir", "--set", "--config", "--resume",
                       "--json", "--quiet", "--debug"):
            assert option in train.out, (name, option)


def test_wheel_holds_one_icml_namespace(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                             "-q", "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = tmp_path.glob("icml-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top <= {"icml", *(n.split("/")[0] for n in names if ".dist-info" in n)}
    for folder in ("cli", "methods", "data", "reports"):
        assert f"icml/{folder}/__init__.py" in names
    for folder in method_folders():
        assert f"icml/methods/{folder}/__init__.py" in names
        sources = sorted(p.name for p in (REPO / "methods" / folder).glob("*.py"))
        assert all(f"icml/methods/{folder}/{s}" in names for s in sources)
    assert not any(n.startswith(("cli/", "methods/", "data/", "reports/", "tests/")) for n in names)


def test_a_listing_whose_reader_has_gone_ends_quietly():
    """`icml list | head -1`: the reader closes the pipe before icml writes; icml ends with 0 and says nothing
    (it used to print a BrokenPipeError line and exit 1)."""
    proc = subprocess.Popen([sys.executable, "-m", "icml.cli.main", "list"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO)
    proc.stdout.close()  # before the import and the listing are done: every write meets a closed pipe
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and err == b"", err.decode()
