"""Atomic file writes (a reader, or a crash, never sees half a file), and reading back what they hold."""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any

from trainprof.errors import UserError


def _read_umask() -> int:
    """The process's umask (set and restored at once: os.umask has no read-only form)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # once, at import: before any thread of ours could create a file meanwhile


def atomic_write_text(path: str | Path, text: str | bytes) -> None:
    """Write `text` (or bytes) to `path` via a temp file in the same directory and os.replace.

    The file gets the mode open() would give it (0666 less the umask): mkstemp's 0600 would leave a run's
    report unreadable to the teammates that TensorBoard's files, written with open(), are readable to.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, data: Any) -> None:
    """JSON, indented; gzipped (no timestamp: the same data, the same bytes) where the name ends in .gz."""
    text = json.dumps(data, indent=2, default=str) + "\n"
    atomic_write_text(path, gzip.compress(text.encode(), mtime=0) if Path(path).suffix == ".gz" else text)


# A run dir's profile; the folders kept in profiles/ store it gzipped (they travel with every GPU call)
PROFILE_NAMES = ("profile.json", "profile.json.gz")


def profile_file(run_dir: str | Path) -> Path | None:
    """The run dir's profile.json, or its gzipped copy, or None."""
    return next((p for p in (Path(run_dir) / n for n in PROFILE_NAMES) if p.is_file()), None)


def kept_profiles(root: str | Path) -> list[Path]:
    """The profile file of each folder under `root` that holds one (profiles/<folder>/), sorted."""
    return sorted(p for p in map(profile_file, Path(root).iterdir() if Path(root).is_dir() else ()) if p)


def read_json(path: str | Path) -> Any:
    """A JSON file, gzipped where its name ends in .gz.

    Raises:
        UserError: the file is not complete JSON (one line naming it and where parsing stopped): what a
            process stopped while writing leaves behind.
    """
    path = Path(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt") as f:
                return json.load(f)
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        where = f"line {err.lineno} col {err.colno}"
    except (EOFError, gzip.BadGzipFile, zlib.error):
        where = "the gzip stream is cut short or damaged"
    except UnicodeDecodeError as err:
        where = f"byte {err.start} is not UTF-8"
    raise UserError(f"{path}: not valid JSON ({where}): the run may have been stopped while writing it; rerun it, "
                    "or pass a complete run dir")


def read_profile(run_dir: str | Path) -> dict[str, Any]:
    """The run dir's profile (profile.json or profile.json.gz); FileNotFoundError without either."""
    path = profile_file(run_dir)
    if path is None:
        raise FileNotFoundError(f"{run_dir}: no profile.json")
    return read_json(path)


def read_yaml(path: str | Path, *, what: str, hint: str, error: type[Exception]) -> Any:
    """Parse a YAML file; a missing file, a directory or a syntax error raises `error` with one line
    naming the file (and line) and `hint`, e.g. what="recipe file", hint="pass a YAML recipe file, e.g. ..."."""
    import yaml

    path = Path(path)
    if path.is_dir():
        raise error(f"{what} '{path}' is a directory; {hint}")
    if not path.is_file():
        raise error(f"{what} '{path}' not found; {hint}")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise error(f"{what} '{path}'{where} is not valid YAML; fix the syntax there") from None


def dig(d: Any, *keys: str) -> Any:
    """d[k1][k2]..., or None where a level is missing or not a dict (documents of any version)."""
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d
