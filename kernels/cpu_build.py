"""Our C kernels for the CPU: compiled once per machine with the system's C compiler, loaded with ctypes.

`load_c_library(source, flags, functions)` compiles `source` (a file beside its launcher in kernels/) with
`cc` (or `$CC`) into `~/.cache/cliffguard/kernels` (`$CLIFFGUARD_KERNEL_CACHE`), the file named by a hash of
the source, the flags and the machine (what `-march=native` compiles for: an x86 CPU's model and flags, an
Arm one's features and part), and returns the library with each function's argument types set.

A library is loaded only where it is this user's and no other user may write it (`_checked`: on Linux the file
opened and checked is the one loaded, through its descriptor): loading runs its code as us, so one another
user left in the folder (or a symbolic link) is made again, ours. A folder that cannot be made or written (or is
full: the compiler says so), or whose library does not load (a `noexec` mount; a file cut short or another machine's: left there, named in a
warning), is passed over for one in the temporary folder. None when there is no compiler, the compile fails or
takes past COMPILE_SECONDS (its children killed too): the launchers then take their torch path. A failed compile
is remembered beside where its build would be (`<name>-<key>.failed`: the compiler and its message) and not tried
again for FAILED_SECONDS by a process with the same compiler (a worker's start would pay it every time, up to
COMPILE_SECONDS for a hung one); delete that file to try again now. A ctypes call releases the GIL and costs
about 2 us, one torch operator's dispatch.
"""

from __future__ import annotations

import contextlib
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
from typing import IO

__all__ = ["load_c_library"]

log = logging.getLogger("cliffguard.kernels")


FULL_BYTES = 4 << 20     # a cache folder with less free is full: a build (its object and library) needs ~1 MiB
COMPILE_SECONDS = 120.0   # one compile step at most (a hung compiler wrapper must not hang a worker's start)
FAILED_SECONDS = 86400.0  # a failed compile is not tried again for this long with the same compiler
_CPU_LINES = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part")


def _cache_dirs() -> list[Path]:
    """Where a build is kept: the configured folder (or the home's cache), then one in the temporary folder
    (where there is one: a read-only machine may have none)."""
    folders = []
    try:   # absolute: a relative one would be another folder in each process (and `x.so` a search of the path)
        env = os.environ.get("CLIFFGUARD_KERNEL_CACHE")
        folders.append(Path(env).expanduser().absolute() if env else Path.home() / ".cache" / "cliffguard" / "kernels")
    except (RuntimeError, KeyError):   # no HOME, and a uid with no passwd entry (a container's arbitrary uid)
        pass
    try:
        folders.append(Path(tempfile.gettempdir()) / f"cliffguard-kernels-{os.geteuid()}")
    except OSError:
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


def _compile(compiler: str, source: Path, flags: Sequence[str], built: Path,
             link_flags: Sequence[str] = ()) -> str | None:
    """Compile `source` with `flags` into an object, then link it alone (with `link_flags` only) into the
    shared library `built`; the error text, or None. Linked apart on purpose: a link given -ffast-math adds
    crtfastmath.o, whose constructor turns on flush-to-zero and denormals-are-zero for the whole process
    that loads the library (every float in it, Python's own included: 5e-324 > 0.0 became False)."""
    steps = ([compiler, *flags, "-fPIC", "-c", "-o", str(built.with_suffix(".o")), str(source)],
             [compiler, "-shared", "-o", str(built), str(built.with_suffix(".o")), "-lm", *link_flags])
    for step in steps:   # its messages to a file, not a pipe: a child the compiler left holds no read open
        with _message_file(built) as err:
            try:   # a session of its own: a timeout ends the compiler's children too (cc1, as, a wrapper's)
                process = subprocess.Popen(step, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                           start_new_session=True, env={**os.environ, "LC_ALL": "C"})
            except OSError as exc:
                return str(exc)
            try:
                process.wait(timeout=COMPILE_SECONDS)
            except BaseException as exc:   # past the time, or interrupted: its own session hears no Ctrl-C
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                if not isinstance(exc, subprocess.TimeoutExpired):
                    raise
                return f"{' '.join(step[:2])}...: no result in {COMPILE_SECONDS:g} s"
            if process.returncode != 0:
                err.seek(0)
                return err.read().decode(errors="replace")[-2000:]
    return None


def load_c_library(source: Path, flags: Sequence[str], functions: Mapping[str, Sequence[type]],
                   link_flags: Sequence[str] = ()) -> ctypes.CDLL | None:
    """`source` compiled with `flags` and linked with `link_flags` (built now if this machine has no copy that
    loads), each of `functions` given its argument types (int return); None without a compiler, where the
    compile fails, or where no cache folder can hold a build that loads (module docstring). The cache key
    covers how it is built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: %s's callers take their torch path", source.name)
        return None
    recipe = " ".join(flags) + " | -fPIC -c, then -shared -lm " + (" ".join(link_flags) or "alone")
    key = hashlib.sha256(source.read_bytes() + recipe.encode() + _machine().encode()).hexdigest()[:16]
    errors: list[str] = []
    for folder in _cache_dirs():
        path = folder / f"{source.stem}-{key}.so"
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if path.exists() and _writable_by_others(path):   # another user's, or an older version's build made
                path.unlink()                                 # under a loose umask: made again, ours
        except OSError as exc:
            errors.append(f"{path}: {exc}")
            continue
        failed = path.with_suffix(".failed")
        if not path.exists():
            if (before := _failed_before(failed, compiler)) is not None:
                errors.append(before)
                break
            error, compiled = _build(compiler, source, flags, path, link_flags)
            if error is not None:
                errors.append(error)
                if compiled:   # the compiler failed: it would again elsewhere (a hang twice as long), and later
                    _remember_failure(failed, compiler, error)
                    break
                continue
        if (library := _load(path, functions, errors)) is not None:
            if errors:   # a copy that does not load is left as it is (a shared home's other machine may load it)
                log.warning("%s: %s; loaded %s instead", source.name, "; ".join(errors), path)
            return library
    log.warning("%s: no build that loads (%s): its callers take their torch path\n%s", source.name, compiler,
                "\n".join(errors))
    return None


def _compiler_identity(compiler: str) -> str:
    """The compiler as a failure remembers it: its file (links resolved), size and time, so that another
    compiler, or this one upgraded, tries a failed build again."""
    try:
        path = os.path.realpath(shutil.which(compiler) or compiler)
        info = os.stat(path)
    except OSError:
        return compiler
    return f"{path} {info.st_size} {info.st_mtime_ns}"


def _failed_before(failed: Path, compiler: str) -> str | None:
    """Why not to compile again: the message of a failure with this compiler remembered in `failed` less than
    FAILED_SECONDS ago (a file of ours only: one another user could write is passed over), or None."""
    try:
        fd = os.open(failed, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if _writable_by_others(fd) or time.time() - info.st_mtime >= FAILED_SECONDS:
            return None
        identity, _, error = file.read().decode(errors="replace").partition("\n")
    if identity != _compiler_identity(compiler):
        return None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.st_mtime))
    return f"failed to compile at {when} with this compiler ({failed}: delete it to try again now): {error}"


def _remember_failure(failed: Path, compiler: str, error: str) -> None:
    """Keep `error` in `failed` with the compiler's identity (`_failed_before` reads it), written whole."""
    kept = None
    try:
        with tempfile.NamedTemporaryFile("wb", dir=failed.parent, prefix=".failed-", delete=False) as file:
            kept = file.name
            file.write(f"{_compiler_identity(compiler)}\n{error}".encode())
        os.chmod(kept, 0o644)
        os.replace(kept, failed)
    except OSError as exc:   # not kept: the next process tries again
        log.info("%s: cannot keep the failure (%s)", failed, exc)
        if kept is not None:
            with contextlib.suppress(OSError):
                os.unlink(kept)


def _writable_by_others(path: Path | int) -> bool:
    """Whether the file at `path` (or open as that descriptor) is no library of ours: not a regular file (a
    symbolic link), another user's, or one another user may write."""
    info = os.fstat(path) if isinstance(path, int) else os.lstat(path)
    return not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or bool(info.st_mode & 0o022)


def _build(compiler: str, source: Path, flags: Sequence[str], path: Path,
           link_flags: Sequence[str] = ()) -> tuple[str | None, bool]:
    """Compile `source` into `path` (atomically: a concurrent compile leaves one whole file): the error, or None,
    and whether it was the compiler's, not the folder's (one that cannot be written, or is full: the compiler
    runs in the C locale, so that its messages of a full disk or quota can be read)."""
    started, error = time.perf_counter(), None
    try:
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            if (error := _compile(compiler, source, flags, built, link_flags)) is None:
                os.chmod(built, 0o755)   # whatever the umask: no other user may write what we load
                os.replace(built, path)
    except OSError as exc:   # a cache folder that cannot be written
        return f"{path.parent}: {exc}", False
    if error is None:
        log.info("compiled %s in %.2f s, once for this machine (%s)", source.name, time.perf_counter() - started, path)
        return None, False
    # a full disk or quota fails the compiler writing its output (its C-locale words), or leaves it no word to
    # say (an assembler's or a linker's cut short): the folder's
    full = any(words in error for words in ("No space left on device", "Disk quota exceeded"))
    return error, not (full or _full(path.parent))


def _message_file(built: Path) -> IO[bytes]:
    """Where a compile step's messages go: a file in the temporary folder (the cache's may be the full one, and
    a message of it lost), else one beside the build."""
    try:
        return tempfile.TemporaryFile()
    except OSError:
        return open(built.with_suffix(".err"), "w+b")


def _full(folder: Path) -> bool:
    """Whether `folder`'s file system has no room left for this user (fewer than FULL_BYTES)."""
    try:
        info = os.statvfs(folder)
    except OSError:
        return False
    return info.f_bavail * info.f_frsize < FULL_BYTES


def _load(path: Path, functions: Mapping[str, Sequence[type]], errors: list[str]) -> ctypes.CDLL | None:
    """The library at `path` with each function's argument types set; None (the reason added to `errors`) where
    it does not load: a file cut short or built elsewhere, a folder mounted `noexec`, a function missing."""
    fd = None
    try:
        name, fd = _checked(path)
        library = ctypes.CDLL(name)
        fd = None   # loaded: its number stays taken (`_checked`)
        for name, argtypes in functions.items():
            getattr(library, name).argtypes = list(argtypes)
            getattr(library, name).restype = ctypes.c_int
    except (OSError, AttributeError) as exc:
        errors.append(f"{path}: {exc}")
        return None
    finally:
        if fd is not None:
            os.close(fd)
    return library


def _checked(path: Path) -> tuple[str, int | None]:
    """What to load for `path`, and the descriptor it is open as: on Linux the very file checked
    (`/proc/self/fd/N`: nobody can swap it between the check and the load, whatever the folders above it), kept
    open once loaded (a number used again would read as a library already loaded). OSError where it is no
    library of ours (`_writable_by_others`)."""
    if not Path("/proc/self/fd").is_dir():
        if _writable_by_others(path):
            raise OSError(f"{path}: not a file of this user's that only it may write")
        return str(path), None
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    if _writable_by_others(fd):
        os.close(fd)
        raise OSError(f"{path}: not a file of this user's that only it may write")
    return f"/proc/self/fd/{fd}", fd
