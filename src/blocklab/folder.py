"""The one way in and out of a run or sweep folder, whose every file may come from anyone.

A folder's root may itself be a link (people link `outputs/` to another disk), but below the root:
- no path component may be a link: each is checked with `lstat`, not only the last (O_NOFOLLOW guards the last);
- a file must be a regular file (no FIFO that blocks a read, no device such as /dev/zero), a folder a folder;
- a path found inside a file (results.json's attention maps) must stay inside the folder;
- a read is capped in bytes per kind of file, so a 3 GB file is refused, not read;
- a write goes to a uniquely named temporary created with O_CREAT | O_EXCL | O_NOFOLLOW, then is renamed into
  place: a reader never sees half a file, and a temporary left by a kill never blocks the next write;
- a saved config is read as data: YAML aliases are refused (a few hundred bytes of them expand exponentially), and
  an interpolation (`${oc.env:HOME}`) is refused rather than resolved.
Libraries that open their own files (W&B, TensorBoard) are handed a folder this module has just created and checked
(`make_dirs`); the others (torch, matplotlib, tokenizers) hand it bytes.

Every refusal is a `FolderError`: one line naming the path and the fix."""
import errno
import json
import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path

import yaml

from blocklab.errors import RunFolderError

KiB, MiB = 2**10, 2**20
# The most bytes read from each kind of file. A run's JSON and YAML are kilobytes; a tokenizer of a large BPE
# vocabulary a few MB; history.json grows with steps and diagnostics. Checkpoints: `checkpoint_cap`.
CAPS = {".json": 64 * MiB, ".yaml": 1 * MiB, ".yml": 1 * MiB, ".png": 64 * MiB, ".jsonl": 64 * MiB,
        ".csv": 64 * MiB, ".md": 16 * MiB}
DEFAULT_CAP = 16 * MiB
# A checkpoint holds the weights, Adam's two moments and a little more, at most 8 bytes per number (float64).
CHECKPOINT_BYTES_PER_PARAMETER, CHECKPOINT_SLACK = 3 * 8, 64 * MiB
# Where the model's size is not known yet: what a model that fits this project's machines can hold.
MAX_CHECKPOINT = 8 * 2**30
FIX = "replace it with the run's own file, or use another folder"
_UMASK = os.umask(0o022)
os.umask(_UMASK)


class FolderError(RunFolderError):
    """A path under a run or sweep folder that BlockLab refuses to read or write."""


def checkpoint_cap(parameters: int) -> int:
    """The most bytes a checkpoint of a model with this many parameters can hold."""
    return parameters * CHECKPOINT_BYTES_PER_PARAMETER + CHECKPOINT_SLACK


def relative(root: Path, path: Path | str) -> Path:
    """`path` (relative to `root`, or under it) as a path inside `root`; a FolderError if it leaves it."""
    root, path = Path(root), Path(path)
    if path.is_absolute():
        try:
            path = path.relative_to(root)
        except ValueError:
            raise FolderError(f"{path} is outside the folder {root}; BlockLab reads and writes only inside it") \
                from None
    if any(part == ".." for part in path.parts) or path.is_absolute():
        raise FolderError(f"{path} leaves the folder {root}; BlockLab reads and writes only inside it")
    return path


def _kind(mode: int) -> str:
    return ("a link" if stat.S_ISLNK(mode) else "a named pipe" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a folder" if stat.S_ISDIR(mode) else "a file" if stat.S_ISREG(mode) else "a special file")


def check(root: Path, path: Path | str, want: str | None = None) -> Path:
    """`root / path`, after checking each component below `root`: none a link, every folder a folder, and the last
    a regular file (`want="file"`) or folder (`want="dir"`) where it exists. A missing path passes: the caller
    decides whether that is an error."""
    root = Path(root)
    rel = relative(root, path)
    current = root
    for index, part in enumerate(rel.parts):
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except (FileNotFoundError, NotADirectoryError):  # missing (a file where a folder of the root's path is)
            return root / rel
        except OSError as err:
            raise FolderError(f"{current} cannot be read ({err.strerror}); {FIX}") from None
        last = index == len(rel.parts) - 1
        expected = want if last else "dir"
        if stat.S_ISLNK(mode) or (expected == "dir" and not stat.S_ISDIR(mode)) \
                or (expected == "file" and not stat.S_ISREG(mode)) \
                or (expected is None and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))):
            what = "a folder" if expected == "dir" else "a regular file"
            raise FolderError(f"{current} is {_kind(mode)}, not {what}; BlockLab follows no link and reads "
                              f"no special file in a run folder: {FIX}")
    return root / rel


# Folders whose contents a library owns (the folder itself is checked): W&B keeps a `latest-run` link in its own.
LIBRARY_FOLDERS = frozenset({"wandb"})


def check_tree(root: Path) -> None:
    """Refuses the first link or special file anywhere below `root` (walked without following links), so a command
    on a crafted folder stops before any work rather than at the first file it happens to open. BlockLab reads
    nothing inside LIBRARY_FOLDERS, so their contents are the library's business."""
    for current, dirs, files in os.walk(root, followlinks=False):
        if Path(current) != Path(root) and Path(current).name in LIBRARY_FOLDERS:
            dirs.clear()
            continue
        for name in sorted(dirs + files):
            mode = os.lstat(Path(current) / name).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise FolderError(f"{Path(current) / name} is {_kind(mode)}; BlockLab follows no link and reads no "
                                  f"special file in a run folder: {FIX}")


def exists(root: Path, path: Path | str) -> bool:
    """Whether anything stands at `root / path` (a link too: reading it is then refused, never followed)."""
    try:
        os.lstat(Path(root) / relative(root, path))
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True


def is_file(root: Path, path: Path | str) -> bool:
    """Whether `root / path` is a regular file reached through no link (a link or special file: FolderError)."""
    full = check(root, path, "file")
    return os.path.lexists(full)


def read_bytes(root: Path, path: Path | str, cap: int | None = None) -> bytes:
    """The file's bytes: a regular file reached through no link, of at most `cap` bytes (CAPS by suffix)."""
    full = check(root, path, "file")
    cap = cap if cap is not None else CAPS.get(full.suffix, DEFAULT_CAP)
    try:  # O_NONBLOCK: a FIFO swapped in after the check opens without waiting for a writer; fstat refuses it
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if err.errno == errno.ENOENT:
            raise
        reason = "a link" if err.errno == errno.ELOOP else err.strerror
        raise FolderError(f"{full} cannot be read ({reason}); {FIX}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FolderError(f"{full} is {_kind(info.st_mode)}, not a regular file; {FIX}")
        if info.st_size > cap:
            raise FolderError(f"{full} is {info.st_size:,} bytes, more than the {cap:,} such a file can "
                              f"hold; {FIX}")
        data = file.read(cap + 1)
    if len(data) > cap:  # grew while read
        raise FolderError(f"{full} is more than the {cap:,} bytes such a file can hold; {FIX}")
    return data


def read_text(root: Path, path: Path | str, cap: int | None = None) -> str:
    """The file as UTF-8 text (UnicodeDecodeError, a ValueError, where it is not)."""
    return read_bytes(root, path, cap).decode("utf-8")


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity: BlockLab writes null


def read_json(root: Path, path: Path | str, cap: int | None = None):
    """The file parsed as strict JSON (no NaN or Infinity); ValueError where it is not JSON."""
    return json.loads(read_text(root, path, cap), parse_constant=_no_constant)


class _DataLoader(yaml.SafeLoader):
    """YAML as plain data: an alias is refused, since aliases of aliases expand exponentially."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError("it uses a YAML alias (*name), which a saved config never holds")
        return super().compose_node(parent, index)


def parse_yaml(text: str, name: str = "config"):
    """YAML text as plain data: no alias expanded, no interpolation resolved (one is a ValueError)."""
    try:
        data = yaml.load(text, Loader=_DataLoader)  # noqa: S506  a safe loader that refuses aliases
    except yaml.YAMLError as err:
        raise ValueError(f"{name} is not plain YAML data ({str(err).splitlines()[0]})") from None
    interpolation = _first_interpolation(data)
    if interpolation is not None:
        raise ValueError(f"{name} holds an interpolation ({interpolation[:60]!r}), which a saved config never "
                         "holds and BlockLab does not resolve")
    return data


def _first_interpolation(value, depth: int = 0):
    if depth > 100:
        raise ValueError("it nests deeper than a config does")
    if isinstance(value, str):
        return value if "${" in value else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _first_interpolation(key, depth + 1) if isinstance(key, str) else None
        found = found or _first_interpolation(item, depth + 1)
        if found is not None:
            return found
    return None


def read_yaml(root: Path, path: Path | str, cap: int | None = None):
    """A saved config as plain data (parse_yaml), read through `read_text`."""
    return parse_yaml(read_text(root, path, cap), str(Path(root) / relative(root, path)))


def make_dirs(root: Path, path: Path | str = ".") -> Path:
    """`root / path` as a folder, creating the root (through any link above it) and each missing folder below it,
    none of which may be a link or a file."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    current = root
    for part in relative(root, path).parts:
        current = current / part
        try:
            os.mkdir(current)
        except FileExistsError:
            pass
        check(root, current.relative_to(root), "dir")
    return current


def write_bytes(root: Path, path: Path | str, data: bytes | memoryview, durable: bool = False) -> Path:
    """Writes `data` to `root / path` atomically: a new temporary beside it, then a rename over it. A link or
    special file standing there, or on the way, is refused, never followed."""
    full = check(root, path, "file")
    make_dirs(root, relative(root, path).parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{full.name}.", suffix=".tmp", dir=full.parent)  # O_EXCL | O_NOFOLLOW
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # as open() would create it: mkstemp's 0600 would hide a shared page
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        check(root, path, "file")  # nothing swapped in meanwhile
        os.replace(tmp, full)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return full


def write_text(root: Path, path: Path | str, text: str) -> Path:
    return write_bytes(root, path, text.encode("utf-8"))


def write_json(root: Path, path: Path | str, value, indent: int | None = 2) -> Path:
    """JSON without NaN or Infinity (a ValueError: convert them to null first)."""
    return write_text(root, path, json.dumps(value, indent=indent, allow_nan=False) + "\n")


def remove(root: Path, path: Path | str) -> None:
    """Removes the file (a link standing there is removed itself, never its target)."""
    rel = relative(root, path)
    check(root, rel.parent, "dir")
    (Path(root) / rel).unlink(missing_ok=True)


def rename(root: Path, source: Path | str, target: Path | str) -> Path:
    """Renames inside the folder; the target must not exist."""
    src, dst = check(root, source), check(root, target)
    if os.path.lexists(dst):
        raise FolderError(f"{dst} already exists; move it away first")
    os.rename(src, dst)
    return dst


LOCK_FILE = ".lock"


class FolderInUse(FolderError):
    """Another process holds the folder's lock."""


@contextmanager
def lock(root: Path, what: str = "BlockLab process"):
    """Holds an exclusive OS lock on `root` (its .lock file) for the block, or refuses at once: FolderInUse where
    another process holds it, FolderError where the folder cannot take the lock file (read-only, a link planted
    as .lock). The kernel drops the lock when its process dies, so a killed process never blocks the next one; the
    lock file is removed, while still held, at the end, so the folder keeps no trace of it."""
    import fcntl  # POSIX only: importing the module needs no lock

    root = Path(root)
    make_dirs(root)
    check(root, LOCK_FILE, "file")
    path = root / LOCK_FILE
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise FolderError(f"cannot lock {root} ({'a link stands at .lock' if err.errno == errno.ELOOP else err.strerror}); "
                              "use a folder you can write to") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FolderInUse(f"{root} is in use by another {what}; wait for it to finish, or use another "
                              "folder") from None
        # The owner may have removed the file between our open and our lock: then the lock guards nothing.
        if os.path.lexists(path) and os.lstat(path).st_ino == os.fstat(fd).st_ino:
            break
        os.close(fd)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # before the release: a waiter then locks a file of its own
        os.close(fd)


def is_locked(root: Path) -> bool:
    """Whether another process holds `root`'s lock (a run still training); creates no lock file."""
    import fcntl

    try:
        fd = os.open(Path(root) / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def inside(root: Path, recorded: str, want: str = "file") -> Path | None:
    """A path a file of the folder records (results.json's attention maps), as a checked path inside the folder;
    None where it leaves the folder, is a link, or is not a regular file."""
    try:
        return check(root, recorded, want)
    except FolderError:
        return None
