"""Our C kernels for the CPU: compiled once per machine with the system's C compiler, loaded with ctypes.

`load_c_library(source, flags, functions)` compiles `source` (a file beside its launcher in kernels/) with
`cc` (or `$CC`) into `~/.cache/cliffguard/kernels` (`$CLIFFGUARD_KERNEL_CACHE`), the file named by a hash of
the source, the flags and the machine (what `-march=native` compiles for: an x86 CPU's model and flags, an
Arm one's features and part), and returns the library with each function's argument types set.

A cache folder is used only where no other user could have put a library there (`_not_private`: the folder
and its library this user's, only it may write them, and every folder above it this user's or root's, written
by others only where sticky, as /tmp): loading runs the library's code as us. One that cannot be made or
written, is not private, or whose library does not load (a `noexec` mount; a file cut short or another
machine's: left there, named in a warning) is passed over for one in the temporary folder. None when there is
no compiler, the compile fails or takes past COMPILE_SECONDS: the launchers then take their torch path. A
ctypes call releases the GIL and costs about 2 us, one torch operator's dispatch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import signal
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
    """Where a build is kept: the configured folder (or the home's cache), then one in the temporary folder
    (where there is one: a read-only machine may have none)."""
    folders = []
    try:
        env = os.environ.get("CLIFFGUARD_KERNEL_CACHE")
        folders.append(Path(env).expanduser() if env else Path.home() / ".cache" / "cliffguard" / "kernels")
    except (RuntimeError, KeyError):   # no HOME, and a uid with no passwd entry (a container's arbitrary uid)
        pass
    try:
        folders.append(Path(tempfile.gettempdir()) / f"cliffguard-kernels-{os.geteuid()}")
    except OSError:
        pass
    return folders


def _not_private(folder: Path) -> str | None:
    """Why no library in `folder` may be loaded (made now where it is missing, only this user may write it),
    or None: the folder is this user's and only it may write it, and each folder above it is this user's or
    root's and written by others only where sticky (/tmp). Anywhere else another user could have made it (or
    renamed ours away) and left a library of theirs, which loading would run as us."""
    uid = os.geteuid()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        real = Path(os.path.realpath(folder))
        info = os.stat(real)
        if info.st_uid != uid or not stat.S_ISDIR(info.st_mode):
            return f"{folder}: not a folder of this user's"
        if info.st_mode & 0o022:   # ours, made under a loose umask: only we may write it from now on
            os.chmod(real, stat.S_IMODE(info.st_mode) & ~0o022)
        for above in real.parents:   # (a group may write one of ours, as a user's private group may)
            info = os.stat(above)
            if info.st_uid not in (uid, 0) or info.st_mode & 0o002 and not info.st_mode & stat.S_ISVTX:
                return f"{folder}: {above} is another user's, or any user may write it"
    except OSError as exc:
        return f"{folder}: {exc}"
    return None


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
        try:   # a session of its own: a timeout ends the compiler's children too (cc1, as, a wrapper's)
            process = subprocess.Popen(step, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       start_new_session=True)
        except OSError as exc:
            return str(exc)
        try:
            _, stderr = process.communicate(timeout=COMPILE_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return f"{' '.join(step[:2])}...: no result in {COMPILE_SECONDS:g} s"
        if process.returncode != 0:
            return stderr[-2000:]
    return None


def load_c_library(source: Path, flags: Sequence[str], functions: Mapping[str, Sequence[type]]
                   ) -> ctypes.CDLL | None:
    """`source` compiled with `flags` (built now if this machine has no copy that loads), each of `functions`
    given its argument types (int return); None without a compiler, where the compile fails, or where no cache
    folder can hold a build that loads (module docstring). The cache key covers how it is built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: %s's callers take their torch path", source.name)
        return None
    recipe = " ".join(flags) + " | -fPIC -c, then -shared -lm alone"
    key = hashlib.sha256(source.read_bytes() + recipe.encode() + _machine().encode()).hexdigest()[:16]
    errors: list[str] = []
    for folder in _cache_dirs():
        path = folder / f"{source.stem}-{key}.so"
        if (unsafe := _not_private(folder)) is not None:
            errors.append(unsafe)
            continue
        try:
            if path.exists() and _writable_by_others(path):   # an older version's build, made under a loose umask
                path.unlink()
        except OSError as exc:
            errors.append(f"{path}: {exc}")
            continue
        if not path.exists():
            error, compiled = _build(compiler, source, flags, path)
            if error is not None:
                errors.append(error)
                if compiled:   # the compiler failed: it would again elsewhere (a hang twice as long)
                    break
                continue
        if (library := _load(path, functions, errors)) is not None:
            if errors:   # a copy that does not load is left as it is (a shared home's other machine may load it)
                log.warning("%s: %s; loaded %s instead", source.name, "; ".join(errors), path)
            return library
    log.warning("%s: no build that loads (%s): its callers take their torch path\n%s", source.name, compiler,
                "\n".join(errors))
    return None


def _writable_by_others(path: Path) -> bool:
    info = os.lstat(path)
    return not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or bool(info.st_mode & 0o022)


def _build(compiler: str, source: Path, flags: Sequence[str], path: Path) -> tuple[str | None, bool]:
    """Compile `source` into `path` (atomically: a concurrent compile leaves one whole file): the error, or None,
    and whether it was the compiler's (not the folder's)."""
    started, error = time.perf_counter(), None
    try:
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            if (error := _compile(compiler, source, flags, built)) is None:
                os.chmod(built, 0o755)   # whatever the umask: no other user may write what we load
                os.replace(built, path)
    except OSError as exc:   # a cache folder that cannot be written
        return f"{path.parent}: {exc}", False
    if error is None:
        log.info("compiled %s in %.2f s, once for this machine (%s)", source.name, time.perf_counter() - started, path)
    return error, error is not None


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
