"""Outputs are published whole or not at all.

Every file or folder storylens writes for a user goes through here:

* :func:`write_bytes_atomic` / :func:`write_text_atomic`: a uniquely named temporary file beside
  the target, flushed and fsynced, then one ``os.replace``. A kill leaves the old file or the new
  one; a symlink at the target is refused (never written through).
* :func:`publish_folder`: a context manager that holds a lock beside the target folder, hands the
  caller a fresh temporary folder beside it to build in, and, when the block ends without error,
  puts the whole set in place in one step: ``renameat2(RENAME_EXCHANGE)`` swaps the two folders
  atomically (Linux), or a plain rename when there is no old folder. The replaced set is then
  removed. A kill at any moment leaves either the old folder or the new one, never a mix; a
  temporary folder a killed run left behind is removed by the next run (which holds the lock, so
  nothing else can be writing it).
* A folder is only replaced if storylens wrote everything in it: each published folder carries a
  manifest (``.storylens.json``) naming its files, and a target that holds anything else is
  refused, so a user's own files are never deleted or overwritten.
* A folder is only replaced by a run of its own kind: the manifest names what wrote it (``what``:
  ``score``, ``patch``, a model folder, ...), and a command refuses a folder another one wrote (a
  ``score --out`` onto a model folder ``export-hf`` wrote would delete the model) unless the user
  says ``--force`` (:func:`replacing_any_kind`), which still never touches a user's own files.

Where ``RENAME_EXCHANGE`` is unavailable (another OS, a filesystem without it), the swap falls back
to two renames with the old set parked as ``.NAME.old-*``; a kill between the two leaves the old
set there and the next run puts it back before doing anything else.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import secrets
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from storylens.core.errors import StorylensError
from storylens.core.files import read_json

MANIFEST = ".storylens.json"
_ANY_KIND: ContextVar[bool] = ContextVar("storylens_replace_any_kind", default=False)


@contextmanager
def replacing_any_kind(on: bool = True) -> Iterator[None]:
    """Inside (``on``): a folder another storylens command wrote may be replaced (``--force``)."""
    token = _ANY_KIND.set(on)
    try:
        yield
    finally:
        _ANY_KIND.reset(token)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def fault_point(name: str) -> None:
    """Fault injection for the tests (tests/faults): ``STORYLENS_INJECT_KILL=NAME`` kills this
    process with SIGKILL when it reaches the point called NAME, as a power cut would."""
    if os.environ.get("STORYLENS_INJECT_KILL") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _tmp_name(target: Path, kind: str) -> Path:
    return target.with_name(f".{target.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def os_error(path: Path, e: OSError, doing: str = "write") -> StorylensError:
    """One line for an OSError: the path and the system's reason (disk full, read-only, ...)."""
    reason = e.strerror or type(e).__name__
    return StorylensError(f"{path}: cannot {doing} ({reason})")


def _refuse_symlink(path: Path) -> None:
    if path.is_symlink():
        raise StorylensError(f"{path}: is a symbolic link; storylens does not write through links")


def write_bytes_atomic(path: str | os.PathLike, data: bytes, fault: str = "file-before-replace") -> Path:
    """``data`` into a temporary file named for this run (pid + random), fsync, one rename.
    ``fault`` names the injection point just before the rename (see :func:`fault_point`)."""
    path = Path(path)
    _refuse_symlink(path)
    if path.is_dir():
        raise StorylensError(f"{path}: is a folder, expected a file path")
    tmp = _tmp_name(path, "tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        fault_point(fault)
        os.replace(tmp, path)
    except OSError as e:
        _unlink_quietly(tmp)
        raise os_error(path, e) from None
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def _unlink_quietly(p: Path) -> None:
    try:
        p.unlink()
    except OSError:
        pass


@contextmanager
def file_lock(lock_path: Path, what: str, remove: bool = False) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (created if needed) or refuse with one line.

    ``remove=True`` deletes the lock file when done (so a user's folder is not littered with
    ``.NAME.lock`` files). That is safe because the file is unlinked while still locked, and a
    run that locks a file only keeps the lock if the path still names that very file (else it
    tries again on the new one): two runs can never both hold "the" lock."""
    for _ in range(100):
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise os_error(lock_path, e, "create the lock file") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StorylensError(
                f"{what}: another storylens run is writing it right now; try again when that one has finished"
            ) from None
        if _same_file(fd, lock_path):
            break
        os.close(fd)  # the holder removed it as we opened it: lock the one now there
    else:
        raise StorylensError(f"{lock_path}: the lock file keeps changing; another run is starting and ending")
    try:
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:
            pass  # the lock is what matters, not its note of who holds it
        yield
    finally:
        if remove:
            _unlink_quietly(lock_path)
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def check_target_folder(out: Path, owned: frozenset[str] = frozenset(), kind: str | None = None) -> None:
    """Refuse a target that is a file, a link, under a file, or a folder holding files storylens
    did not write (anything not in its manifest; ``owned`` names a folder of this kind always
    holds, for folders made before manifests existed); with ``kind``, also a folder another kind of
    run wrote (its manifest's ``what``), unless :func:`replacing_any_kind`."""
    if out.name in ("", ".", ".."):
        raise StorylensError(f"{out}: give the output folder a name of its own (not '.' or '..')")
    if out.is_symlink():
        raise StorylensError(f"{out}: is a symbolic link; give a real folder")
    if out.exists() and not out.is_dir():
        raise StorylensError(f"{out}: exists and is not a folder")
    for parent in out.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise StorylensError(f"{out}: {parent} is not a folder")
            break
    if not out.is_dir():
        return
    try:
        present = {p.name for p in out.iterdir()}
    except OSError as e:
        raise os_error(out, e, "read") from None
    if not present:
        return
    listed = _manifest_files(out)
    if listed is None and owned and present <= owned:
        return
    if listed is None:
        raise StorylensError(
            f"{out}: holds files storylens did not write ({_some(present)}); give an empty or new folder"
        )
    foreign = present - listed - owned - {MANIFEST}
    if foreign:
        raise StorylensError(
            f"{out}: holds files storylens did not write ({_some(foreign)}); move them away or give another folder"
        )
    other = _manifest_kind(out)
    if kind is not None and other is not None and other != kind and not _ANY_KIND.get():
        raise StorylensError(
            f"{out}: holds a {other} that storylens wrote, not a {kind}; give another folder (or --force to replace it)"
        )


def _some(names) -> str:
    names = sorted(names)
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _manifest_files(folder: Path) -> set[str] | None:
    try:
        data = read_json(folder / MANIFEST)
        return set(data["files"])
    except (OSError, ValueError, KeyError, TypeError, StorylensError):  # no manifest storylens could have written
        return None


def _manifest_kind(folder: Path) -> str | None:
    """What wrote ``folder`` (its manifest's ``what``; None: no manifest, or one without it)."""
    try:
        what = read_json(folder / MANIFEST).get("what")
    except (OSError, ValueError, AttributeError, StorylensError):
        return None
    return what if isinstance(what, str) else None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported here."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    r = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if r == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _clean_leftovers(out: Path) -> None:
    """Under the lock: put back an old set parked by an interrupted fallback swap, then remove
    every temporary folder an earlier killed run left."""
    parent = out.parent
    prefix = f".{out.name}."
    try:
        entries = [p for p in parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return
    parked = sorted(p for p in entries if p.name.startswith(prefix + "old-"))
    if parked and not out.exists():
        os.rename(parked[-1], out)
        parked = parked[:-1]
    for p in entries:
        if p.exists() and (p.name.startswith(prefix + "build-") or p in parked):
            shutil.rmtree(p, ignore_errors=True)


def lock_path_for(out: Path) -> Path:
    return out.with_name(f".{out.name}.lock")


@contextmanager
def publish_folder(out: str | os.PathLike, what: str = "output", owned: frozenset[str] = frozenset()) -> Iterator[Path]:
    """Build into the yielded temporary folder; on success it replaces ``out`` in one step.

    ``out`` must be new, empty, or a folder storylens published before (see the module docstring).
    On an error (or a kill) ``out`` is left exactly as it was.
    """
    out = Path(out)
    check_target_folder(out, owned, what)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_error(out.parent, e, "create") from None
    with file_lock(lock_path_for(out), str(out), remove=True):
        try:
            _clean_leftovers(out)
        except OSError as e:
            raise os_error(out, e, "tidy") from None
        check_target_folder(out, owned, what)  # again, now that nobody else can be writing it
        tmp = _tmp_name(out, "build")
        try:
            tmp.mkdir()
        except OSError as e:
            raise os_error(out.parent, e) from None
        try:
            yield tmp
            fault_point("folder-built")
            files = sorted(p.name for p in tmp.iterdir())
            (tmp / MANIFEST).write_text(
                json.dumps({"written_by": "storylens", "what": what, "files": files}, indent=1), encoding="utf-8"
            )
            _fsync_tree(tmp)
            fault_point("folder-before-swap")
            _swap_in(tmp, out)
        except OSError as e:
            raise os_error(out, e) from None
        except StorylensError as e:  # a writer of its own (write_text_atomic) named a file in the build folder
            raise _named_for(e, tmp, out) from None
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def _named_for(e: StorylensError, tmp: Path, out: Path) -> StorylensError:
    """``e`` as the user should read it: a file inside the build folder is ``out`` itself (the build
    folder is never seen). Any other error is returned unchanged."""
    msg = str(e)
    if not msg.startswith(str(tmp)):
        return e
    rest = msg[len(str(tmp)) :]
    cut = rest.find(": ")
    return StorylensError(f"{out}{rest[cut:]}") if cut >= 0 else e


def _fsync_tree(folder: Path) -> None:
    for p in folder.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_in(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.rename(tmp, out)  # nothing to replace: one rename
        return
    if _exchange(tmp, out):
        fault_point("folder-after-swap")
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old set
        return
    parked = _tmp_name(out, "old")
    os.rename(out, parked)
    os.rename(tmp, out)
    shutil.rmtree(parked, ignore_errors=True)
