"""How autotune reads and writes files: atomically, UTF-8 checked, errors as one line.

Every file a sweep writes (probe results, trials.csv, best.yaml, exports) is written whole or
not at all, and its temporary file never outlives a failed write. Every file a user gives (a
search space, a base config, a trainer YAML) is read as UTF-8, with one clear line when it is
not, and above MAX_TEXT_FILE_BYTES is refused unread. Every YAML autotune reads goes through
load_yaml: libyaml's parser where it is installed, a key given twice in one mapping refused
with its line, aliases that expand past MAX_YAML_VALUES values (an anchor bomb) refused before
anything reads the values. An OSError from the disk (full, read-only, permission, a name too
long) becomes one line that says which file and what to do. Imports nothing of autotune but
errors.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

from autotune.errors import AutotuneError, ConfigError

# what a JSON file holds: the files autotune writes and reads back (probe results, requests,
# a study's stored attributes); a foreign payload read from elsewhere stays Any where read
# (nested values are read-only Sequence and Mapping, so a dict[str, int] is one as it is)
JsonValue: TypeAlias = ("None | bool | int | float | str | Sequence[JsonValue] | "
                        "Mapping[str, JsonValue]")
JsonObject: TypeAlias = "dict[str, JsonValue]"

# the largest file a user gives autotune to read (a search space, a base config, a trainer YAML:
# kilobytes each); a larger one is refused before it is read, in well under a second
MAX_TEXT_FILE_BYTES = 2**20
# the most values a YAML document may hold once its aliases are expanded: a file under
# MAX_TEXT_FILE_BYTES holds fewer without aliases (a value takes two bytes at least)
MAX_YAML_VALUES = 1_000_000

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


LOG_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW  # a probe's log: made new,
# never through a symbolic link planted where it goes (open fails with ELOOP there)


def open_log(path: str | os.PathLike[str]) -> int:
    """A probe's log opened for writing, emptied (mode 0666 less the umask): its descriptor.
    OSError on a symbolic link at `path` (ELOOP): a link is never followed."""
    return os.open(path, LOG_FLAGS, 0o666)


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
        with path.open("rb") as handle:
            data = handle.read(MAX_TEXT_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read ({(exc.strerror or str(exc)).lower()})") \
            from None
    if len(data) > MAX_TEXT_FILE_BYTES:
        raise ConfigError(f"{what} {path}: larger than {MAX_TEXT_FILE_BYTES // 2**20} MiB, not a "
                          "config (those are kilobytes); check the path")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{what} {path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} "
                          "at offset {0}); save the file as UTF-8".format(exc.start)) from None


def load_yaml(text: str, where: str) -> Any:
    """The one YAML document in `text`, read safely (plain data, no Python objects), or
    ConfigError `<where>:<line>: ...` when it is not valid YAML, gives a key twice in one
    mapping, or holds aliases that expand past MAX_YAML_VALUES values."""
    import yaml

    loader = _loader_class()(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if "*" in text:  # an alias: its expansion is counted before anything reads it
            _check_expansion(node, where)
        return loader.construct_document(node)
    except (yaml.YAMLError, RecursionError) as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(err, "problem", None) or err).split())
        raise ConfigError(f"{where}{line}: not valid YAML ({problem})") from None
    finally:
        loader.dispose()


@functools.cache
def _loader_class() -> type:
    """yaml's safe loader, libyaml's (C, about 10 times faster) where installed, that refuses
    a key given twice in one mapping (a merge `<<` may still be overridden, as YAML means)."""
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class Loader(base):  # type: ignore[valid-type,misc]
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.get(key)
                    except TypeError:  # an unhashable key: the constructor says so
                        continue
                    if first is not None:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {key!r} given twice (first on line {first}); "
                            "give it once", key_node.start_mark)
                    seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep=deep)

    return Loader


def _check_expansion(root: Any, where: str) -> None:
    """ConfigError when the document's values, each alias counted as a copy of what it names,
    number more than MAX_YAML_VALUES; each node is counted once (without recursion)."""
    import yaml

    counted: dict[int, int] = {}
    open_nodes: set[int] = set()  # nodes whose children are still being counted
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in counted:
            continue
        children = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [item for pair in node.value for item in pair]
        if not children_done:
            if id(node) in open_nodes:
                raise ConfigError(f"{where}:{node.start_mark.line + 1}: an alias names a value "
                                  "that holds it (a loop); write the values out")
            open_nodes.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children
                         if id(child) not in counted and not isinstance(child, yaml.ScalarNode))
            continue
        total = 1 + sum(1 if isinstance(child, yaml.ScalarNode) else counted[id(child)]
                        for child in children)
        if total > MAX_YAML_VALUES:
            raise ConfigError(f"{where}:{node.start_mark.line + 1}: its aliases expand to more "
                              f"than {MAX_YAML_VALUES:,} values; write the values out")
        counted[id(node)] = total
        open_nodes.discard(id(node))
