"""Our C kernels for the CPU: compiled once per machine with the system's C compiler, loaded with ctypes.

`load_c_library(source, flags, functions)` compiles `source` (a file beside its launcher in kernels/) with
`cc` (or `$CC`) into `~/.cache/cliffguard/kernels` (`$CLIFFGUARD_KERNEL_CACHE`), the file named by a hash of
the source, the flags and the machine (what `-march=native` compiles for: an x86 CPU's model and flags, an
Arm one's features and part), and returns the library with each function's argument types set.
A cache folder that cannot be written, or whose library does not load (a `noexec` mount, a file cut short or
another machine's: left there, named in a warning), is passed over for one in the temporary folder, used only
where it is this user's and only it can write it. None when there is no compiler, the compile fails or takes past COMPILE_SECONDS: the launchers then
take their torch path. A ctypes call releases the GIL and costs about 2 us, one torch operator's dispatch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["load_c_library"]

log = logging.getLogger("cliffguard.kernels")


COMPILE_SECONDS = 120.0   # one compile step at most (a hung compiler wrapper must not hang a worker's start)
_CPU_LINES = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part")


def _cache_dirs() -> list[Path]:
    """Where a build is kept: the configured folder (or the home's cache), then one in the temporary folder."""
    folders = [Path(tempfile.gettempdir()) / f"cliffguard-kernels-{os.getuid()}"]
    try:
        env = os.environ.get("CLIFFGUARD_KERNEL_CACHE")
        folders.insert(0, Path(env).expanduser() if env else Path.home() / ".cache" / "cliffguard" / "kernels")
    except (RuntimeError, KeyError):   # no HOME, and a uid with no passwd entry (a container's arbitrary uid)
        pass
    return folders


def _machine() -> str:
    """The CPU's model and flags (x86) or features and part (Arm: its /proc/cpuinfo has neither a model name
    nor flags): a cache shared by two kinds of CPU keeps a build for each, never one's -march=native code
    run on the other (an illegal instruction kills the process)."""
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(_CPU_LINES)]
    return platform.machine() + "\n" + "\n".join(sorted(set(lines)))


def _compile(compiler: str, source: Path, flags: Sequence[str], built: Path) -> str | None:
    """Compile `source` with `flags` into an object, then link it alone into the shared library `built`;
    the error text, or None. Linked apart on purpose: a link given -ffast-math adds crtfastmath.o, whose
    constructor turns on flush-to-zero and denormals-are-zero for the whole process that loads the
    library (every float in it, Python's own included: 5e-324 > 0.0 became False)."""
    steps = ([compiler, *flags, "-fPIC", "-c", "-o", str(built.with_suffix(".o")), str(source)],
             [compiler, "-shared", "-o", str(built), str(built.with_suffix(".o")), "-lm"])
    for step in steps:
        try:
            result = subprocess.run(step, capture_output=True, text=True, timeout=COMPILE_SECONDS)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return str(exc)
        if result.returncode != 0:
            return result.stderr[-2000:]
    return None


def load_c_library(source: Path, flags: Sequence[str], functions: Mapping[str, Sequence[type]]
                   ) -> ctypes.CDLL | None:
    """`source` compiled with `flags` (built now if this machine has no copy that loads), each of `functions`
    given its argument types (int return); None without a compiler. The cache key covers how it is built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: %s's callers take their torch path", source.name)
        return None
    recipe = " ".join(flags) + " | -fPIC -c, then -shared -lm alone"
    key = hashlib.sha256(source.read_bytes() + recipe.encode() + _machine().encode()).hexdigest()[:16]
    errors: list[str] = []
    for folder in _cache_dirs():
        path = folder / f"{source.stem}-{key}.so"
        if folder.parent == Path(tempfile.gettempdir()) and (unsafe := _not_private(folder)) is not None:
            errors.append(unsafe)
        elif not path.exists() and (error := _build(compiler, source, flags, path)) is not None:
            errors.append(error)
        elif (library := _load(path, functions, errors)) is not None:
            if errors:   # a copy that does not load is left alone: one in use by another process is never touched
                log.warning("%s: %s; loaded %s instead", source.name, "; ".join(errors), path)
            return library
    log.warning("%s: no build that loads (%s): its callers take their torch path\n%s", source.name, compiler,
                "\n".join(errors))
    return None


def _not_private(folder: Path) -> str | None:
    """Why the temporary folder's cache may not be used (made now, only the user can write it), or None: in a
    folder every user writes, another could have made it first and left a library of theirs there, which
    loading would run as us."""
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError as exc:
        return f"{folder}: {exc}"
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        return f"{folder}: not a folder of this user's that only it can write; not used"
    return None


def _build(compiler: str, source: Path, flags: Sequence[str], path: Path) -> str | None:
    """Compile `source` into `path` (atomically: a concurrent compile leaves one whole file); the error, or None."""
    started = time.perf_counter()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            error = _compile(compiler, source, flags, built)
            if error is None:
                os.replace(built, path)
    except OSError as exc:   # a cache folder that cannot be written
        error = f"{path.parent}: {exc}"
    if error is None:
        log.info("compiled %s in %.2f s, once for this machine (%s)", source.name, time.perf_counter() - started, path)
    return error


def _load(path: Path, functions: Mapping[str, Sequence[type]], errors: list[str]) -> ctypes.CDLL | None:
    """The library at `path` with each function's argument types set; None (the reason added to `errors`) where
    it does not load: a file cut short or built elsewhere, a folder mounted `noexec`, a function missing."""
    try:
        library = ctypes.CDLL(str(path))
        for name, argtypes in functions.items():
            getattr(library, name).argtypes = list(argtypes)
            getattr(library, name).restype = ctypes.c_int
    except (OSError, AttributeError) as exc:
        errors.append(f"{path}: {exc}")
        return None
    return library
