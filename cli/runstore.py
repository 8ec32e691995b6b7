"""The run store: `runs/<method>/<run-id>/` with run.json, config.json, metrics.parquet,
extra tables, checkpoints/ and report/.

run.json is the run's identity card (who, what, when, on which versions) and its status:
running | completed | failed | interrupted, per phase (train, eval) and overall.
"""
from __future__ import annotations

import json
import os
import platform
import re
import secrets
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from .errors import UsageError

STATUSES = ("running", "completed", "failed", "interrupted")
VERSIONED_PACKAGES = ("torch", "transformers", "diffusers", "torch_geometric", "numpy", "pandas", "pyarrow")


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


_umask: int | None = None


def file_mode() -> int:
    """The mode an ordinary `open(path, "w")` gives a new file here: 0666 less the process's umask."""
    global _umask
    if _umask is None:
        _umask = os.umask(0o022)  # reading the umask means setting it: put it straight back
        os.umask(_umask)
    return 0o666 & ~_umask


def temp_sibling(path: Path) -> str:
    """A new empty temporary file beside `path`, for a write that is renamed onto it. mkstemp makes it
    0600; it gets the umask's mode instead, so a run on a shared --runs-dir stays readable by others."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, file_mode())
    return tmp


def atomic_write_text(path: Path, text: str) -> None:
    tmp = temp_sibling(path)
    try:
        with open(tmp, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) into a sibling file, then rename it onto `path`: readers and an interrupted run
    never see a half-written file. The temporary name keeps the suffix (np.savez adds .npz otherwise)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_torch_save(obj: Any, path: Path) -> None:
    import torch

    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def load_checkpoint(path: Path, map_location: Any = None) -> Any:
    """A checkpoint of a run, read with torch's `weights_only=True`: tensors and plain containers only.
    A run directory may come from a shared --runs-dir, a colleague or an archive, and a full unpickle
    would run whatever code its file names; anything else in the file is refused in one line."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        named = re.search(r"GLOBAL ([\w.]+)", str(exc))
        detail = f" (it names {named.group(1)})" if named else ""
        raise UsageError(f"checkpoint '{path}' holds more than tensors and plain containers{detail}; "
                         "loading it could run code", "re-create the run with this version of icml") from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise UsageError(f"checkpoint '{path}' cannot be read ({str(exc).splitlines()[0][:160]})",
                         "re-create the run, or resume it from its last good checkpoint") from None


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def package_versions() -> dict[str, str | None]:
    """Installed versions, read from package metadata (imports nothing heavy)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        versions["icml"] = metadata.version("icml")
    except metadata.PackageNotFoundError:
        versions["icml"] = None
    return versions


def git_commit() -> str | None:
    source = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=source, capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=source,
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


class Run:
    """One run directory. All writes are atomic."""

    def __init__(self, path: Path):
        self.path = Path(path)

    # files ----------------------------------------------------------------
    @property
    def info_path(self) -> Path:
        return self.path / "run.json"

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.parquet"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def report_dir(self) -> Path:
        return self.path / "report"

    def table_path(self, name: str) -> Path:
        return self.path / f"{name}.parquet"

    def table(self, name: str):
        """The run's extra table `<name>.parquet` as a DataFrame, or None if it was not written."""
        import pandas as pd

        path = self.table_path(name)
        return pd.read_parquet(path) if path.exists() else None

    # run.json --------------------------------------------------------------
    def info(self) -> dict:
        try:
            data = json.loads(self.info_path.read_text())
        except FileNotFoundError:
            raise UsageError(f"'{self.path}' is not a run directory (no run.json)",
                             "pass a directory under runs/<method>/, see 'icml runs'") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UsageError(f"run.json in '{self.path}' is corrupt",
                             "delete the run directory or restore run.json") from None
        if not isinstance(data, dict) or "method" not in data or "run_id" not in data:
            raise UsageError(f"run.json in '{self.path}' lacks method/run_id",
                             "delete the run directory or restore run.json")
        return data

    def update(self, **changes: Any) -> dict:
        data = self.info()
        data.update(changes)
        atomic_write_json(self.info_path, data)
        return data

    def set_phase(self, phase: str, status: str, **extra: Any) -> dict:
        assert status in STATUSES
        data = self.info()
        entry = dict(data.get("phases", {}).get(phase, {}))
        if status == "running":
            entry = {"status": status, "started": now(), "argv": sys.argv[1:]}
        else:
            entry.update(status=status, ended=now())
        entry.update(extra)
        data.setdefault("phases", {})[phase] = entry
        data["status"] = status
        data["updated"] = now()
        atomic_write_json(self.info_path, data)
        return data

    def phase_status(self, phase: str) -> str | None:
        return self.info().get("phases", {}).get(phase, {}).get("status")

    @property
    def run_id(self) -> str:
        return self.info()["run_id"]

    def config_record(self) -> dict:
        try:
            data = json.loads(self.config_path.read_text())
        except FileNotFoundError:
            raise UsageError(f"'{self.path}' has no config.json", "re-create the run with train") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UsageError(f"config.json in '{self.path}' is corrupt",
                             "restore it or re-create the run with train") from None
        return data


class RunStore:
    """The runs directory: create runs, find them, list them."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def create(self, method: str, preset: str, seed: int, device: str, config_tree: dict,
               group: str | None = None) -> Run:
        """A new run directory; `group` is the id shared by the runs of one multi-seed command."""
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")[:-3]  # ms: names sort in creation order
        run_id = f"{stamp}-{preset}-s{seed}-{secrets.token_hex(2)}"
        path = self.root / method / run_id
        path.mkdir(parents=True, exist_ok=False)
        run = Run(path)
        atomic_write_json(run.config_path, {"method": method, "preset": preset, "seed": seed,
                                            "config": config_tree})
        atomic_write_json(run.info_path, {
            "run_id": run_id, "method": method, "preset": preset, "seed": seed, "device": device,
            "argv": sys.argv[1:], "status": "running", "started": now(), "updated": now(),
            "phases": {}, "versions": package_versions(), "git_commit": git_commit(),
            "host": platform.node(), **({"group": group} if group else {}),
        })
        return run

    def group(self, group: str, method: str | None = None) -> list[Run]:
        """The runs recorded with group id `group`, oldest first."""
        found = []
        for run in self.runs(method):
            try:
                if run.info().get("group") == group:
                    found.append(run)
            except UsageError:
                continue
        if not found:
            raise UsageError(f"no runs of group '{group}' in '{self.root}'",
                             "see 'icml runs' (the group column) or train with --seeds")
        return found

    def latest_group(self, method: str, phase: str, seeds: list[int] | None = None) -> list[Run]:
        """The runs of the newest group of `method` whose `phase` completed, for every one of `seeds`
        (default: the group's seeds)."""
        seen = set()
        for run in reversed(self.runs(method)):
            try:
                group = run.info().get("group")
            except UsageError:
                continue
            if not group or group in seen:
                continue
            seen.add(group)
            done = {}
            for member in self.group(group, method):
                if member.phase_status(phase) == "completed":
                    done.setdefault(member.info()["seed"], member)
            wanted = seeds if seeds is not None else sorted(done)
            if wanted and all(s in done for s in wanted):
                return [done[s] for s in wanted]
        which = f"seeds {','.join(map(str, seeds))}" if seeds else "several seeds"
        raise UsageError(f"no group of {method} with a completed {phase} for {which} in '{self.root}'",
                         f"run 'icml {method} train --seeds 0,1,2' first, or pass --group / --runs-dir")

    def runs(self, method: str | None = None) -> list[Run]:
        """Every directory holding a run.json, oldest first (run ids start with a timestamp)."""
        if not self.root.exists():
            return []
        methods = [self.root / method] if method else sorted(p for p in self.root.iterdir() if p.is_dir())
        found = []
        for folder in methods:
            if folder.is_dir():
                found += [Run(p) for p in sorted(folder.iterdir()) if (p / "run.json").exists()]
        return sorted(found, key=lambda r: (r.path.name, str(r.path)))

    def latest(self, method: str, phase: str) -> Run:
        """The newest run of `method` whose `phase` completed."""
        for run in reversed(self.runs(method)):
            try:
                if run.phase_status(phase) == "completed":
                    return run
            except UsageError:
                continue  # a corrupt run.json does not hide older good runs
        raise UsageError(f"no run of {method} with a completed {phase} in '{self.root}'",
                         f"run 'icml {method} {'train' if phase == 'train' else phase}' first, "
                         f"or pass a run directory / --runs-dir")

    def open(self, path: str | Path, method: str | None = None) -> Run:
        path = Path(path)
        if not path.exists():
            raise UsageError(f"run directory '{path}' does not exist", "see 'icml runs' for the runs")
        if not path.is_dir():
            raise UsageError(f"'{path}' is not a directory", "pass a run directory, see 'icml runs'")
        run = Run(path)
        info = run.info()
        if method and info["method"] != method:
            raise UsageError(f"'{path}' is a run of {info['method']}, not {method}",
                             f"use 'icml {info['method']} …' for it")
        return run
