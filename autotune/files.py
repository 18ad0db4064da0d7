"""How autotune reads and writes files: atomically, UTF-8 checked, errors as one line.

Every file a sweep writes (probe results, trials.csv, best.yaml, exports) is written whole or
not at all, and its temporary file never outlives a failed write. Every file a user gives (a
search space, a base config, a trainer YAML) is read as UTF-8, with one clear line when it is
not. An OSError from the disk (full, read-only, permission, a name too long) becomes one line
that says which file and what to do. Imports nothing of autotune but errors.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeAlias

from autotune.errors import AutotuneError, ConfigError

# what a JSON file holds: the files autotune writes and reads back (probe results, requests,
# a study's stored attributes); a foreign payload read from elsewhere stays Any where read
# (nested values are read-only Sequence and Mapping, so a dict[str, int] is one as it is)
JsonValue: TypeAlias = ("None | bool | int | float | str | Sequence[JsonValue] | "
                        "Mapping[str, JsonValue]")
JsonObject: TypeAlias = "dict[str, JsonValue]"

# what to do about each disk error, after "<path>: <strerror>"
_ADVICE = {
    errno.ENOSPC: "free some space, then run the same command again (nothing is lost)",
    errno.EDQUOT: "free some space under your quota, then run the same command again",
    errno.EROFS: "pass --results-dir (or --out) on a writable disk",
    errno.EACCES: "pass --results-dir (or --out) to a folder you may write",
    errno.EPERM: "pass --results-dir (or --out) to a folder you may write",
    errno.ENAMETOOLONG: "use a shorter name",
    errno.ENOTDIR: "a file stands where a folder is needed; pick another path",
    errno.ENOENT: "create the folder first, or pick another path",
    errno.EIO: "the disk reported an I/O error; check it, then run the same command again",
}


class DiskError(AutotuneError):
    """The disk refused a read or write autotune needs (full, read-only, no permission)."""

    exit_code = 1


def describe_os_error(exc: OSError, path: str | os.PathLike[str] | None = None) -> str:
    """`<path>: <what happened>; <what to do>`, one line."""
    where = path or exc.filename or "a file"
    what = (exc.strerror or type(exc).__name__).lower()
    advice = _ADVICE.get(exc.errno or 0)
    if exc.errno == errno.ENOENT and Path(where).parent.is_dir():  # /proc, /sys: a folder
        what, advice = f"{Path(where).parent} takes no new files", "pick another path"
    return f"{where}: {what}" + (f"; {advice}" if advice else "")


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write a file so that readers see either nothing or the whole of it. On failure (a full
    disk) the temporary file is removed and the old file, if any, is left as it was. The file
    gets the mode open() would give it (0666 less the umask), set by os.open's own mode
    argument: the process umask is never changed, not even for an instant."""
    path = Path(path)
    fd, tmp = _create_temporary(path)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _create_temporary(path: Path) -> tuple[int, str]:
    """A new file beside `path` under a fresh hidden name, opened for writing with mode 0666
    (the umask applies); the OSError of a refusal names `path`, not the temporary name."""
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue
        except OSError as exc:  # said of the file asked for, not of a temporary name
            exc.filename = str(path)
            raise
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path))


def read_text_file(path: str | os.PathLike[str], what: str) -> str:
    """A user's text file as a string; ConfigError naming `what` and the path when it cannot be
    read or is not UTF-8 (a YAML file written in another encoding, or a binary file)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} {path}: is a directory; give a file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read ({(exc.strerror or str(exc)).lower()})") \
            from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{what} {path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} "
                          "at offset {0}); save the file as UTF-8".format(exc.start)) from None
