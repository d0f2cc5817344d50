"""Writing outputs so that a reader never sees half of one and nothing the user did not ask to
replace is ever removed.

Every command that writes goes through this module:

* `check_output_dir` / `check_output_file` run before any work (and again at the moment of
  replacing): an existing output is replaced only when it is a previous trtspec output of the
  same kind (its marker file `.trtspec-output` says so; an engine directory's manifest.json too).
  Never the current directory or one of its parents, an input or a directory holding one, a
  path inside an input (see `protected_directories`: a directory input's whole tree, the model
  directory holding an input, trtspec's bundled models), a directory that is not a trtspec
  output of that kind, a path inside another trtspec output (which its next rebuild would
  delete), a directory where a file belongs, a device or pipe, a place that cannot be written,
  an empty path (`check_named`: '' would name the current directory) or a path through a symbolic
  link into a directory that does not exist (missing directories are made only along the path as
  given, never at a link's target). `check_work_dir` applies the same rule to a work directory (which is never replaced,
  so it may exist), and `check_distinct_outputs` keeps one command's outputs apart. Each
  refusal is one `TrtspecError` line naming both paths.
* `staged_directory` / `staged_file` fill a uniquely named hidden sibling (in the destination's
  own directory, so the final rename is atomic) and rename it into place. The sibling is removed
  on every exit path: errors, Ctrl-C and SIGTERM (turned into an exception while it exists).
  Siblings left by runs killed outright (SIGKILL, power loss) carry the host and process id in
  their names and are removed by the next run once that process is gone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import stat
import tempfile
import threading
from pathlib import Path
from typing import Iterable, Iterator

from trtspec.errors import TrtspecError

BUNDLED = Path(__file__).resolve().parent / "assets"  # trtspec's bundled models: never an output

MARKER = ".trtspec-output"            # inside every directory written by staged_directory: {"kind": ...}
ENGINE = "engine directory"           # the kinds of directory outputs
TRITON_REPOSITORY = "Triton model repository"
POLICY = "BlockPilot policy"
CHECKPOINT = "checkpoint"
DRAFT_VOCAB = "draft vocabulary"
STAGING, TEMPORARY, REPLACED = "trtspec-staging", "trtspec-tmp", "trtspec-old"

PathLike = str | os.PathLike
CACHE_ENV = "TRTSPEC_CACHE"
# OSErrors that mean "this place cannot take the output", reported as one line, not a traceback
WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)


def cache_root() -> Path:
    """Where trtspec keeps what it builds on its own (engines for `--backend auto`, exported graphs)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trtspec"


def key_digest(key: dict, length: int = 24) -> str:
    """A cache entry's name: the SHA-256 of `key` as sorted JSON (tuples as lists, other values by
    str), cut to `length` hex digits."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:length]


@contextlib.contextmanager
def take_turns(lock: Path) -> Iterator[None]:
    """Hold an exclusive lock on `lock` (released by the OS if the process dies), so processes that
    would make the same cache entry at once make it one after the other and the later ones read it;
    no lock where the cache cannot be written."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock, "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:  # hashlib.file_digest would need Python 3.11
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _resolved(path: PathLike) -> Path:
    return Path(os.path.abspath(os.path.realpath(os.path.expanduser(os.fspath(path)))))


def _inputs(inputs: Iterable[PathLike | None]) -> list[tuple[Path, Path]]:
    """(as given, resolved) for every input that names something on disk, and trtspec's bundled
    models, which are an input of every command that is not given another model."""
    named = [(Path(p), _resolved(p)) for p in inputs if p is not None and os.path.lexists(p)]
    return [*named, (BUNDLED, _resolved(BUNDLED))]


# The description files of the model directories trtspec reads: a checkpoint (Hugging Face or z-lab
# layout), a BlockPilot policy, draft-vocabulary counts; each sits beside *.safetensors weights.
MODEL_CONFIGS = ("config.json", "policy.json", "draft_vocab.json")


def _model_directory(directory: Path) -> bool:
    """Whether `directory` holds one model's data as a whole: a description file with weights
    (`MODEL_CONFIGS`), or a trtspec output (an engine, any marked directory)."""
    try:
        if not directory.is_dir():
            return False
        described = any((directory / name).is_file() for name in MODEL_CONFIGS)
        return output_kind(directory) is not None or (described and any(directory.glob("*.safetensors")))
    except OSError:
        return False


def protected_directories(inputs: Iterable[PathLike | None]) -> list[tuple[Path, str]]:
    """The directories no output may be written into, each with a phrase naming it: every
    directory input's whole tree, and the directory holding an input (file or directory) when that
    is a model directory (`_model_directory`), so `--json ./drafter/model.safetensors` or
    `--json ./drafter/blockpilot/policy.json` cannot replace part of an input drafter."""
    protected = []
    for given, source in _inputs(inputs):
        if source.is_dir():
            name = f"trtspec's bundled models {source}" if given is BUNDLED else f"the input {given}"
            protected.append((source, name))
        if _model_directory(source.parent):
            protected.append((source.parent, f"{source.parent}, the model directory holding the input {given}"))
    return protected


def _json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def output_kind(directory: Path) -> str | None:
    """The kind of trtspec output `directory` is, from its marker; an engine directory written
    before markers existed is recognised by its manifest. None for anything else."""
    kind = _json_object(directory / MARKER).get("kind")
    if isinstance(kind, str):
        return kind
    manifest = _json_object(directory / "manifest.json")
    return ENGINE if {"manifest_version", "backend", "artifacts"} <= manifest.keys() else None


def check_named(path: PathLike | None, what: str = "the output path") -> None:
    """Refuse an empty output path: '' names the current directory to a file system call, and a
    command that tests it as a flag would write nothing and say nothing."""
    if path is not None and not os.fspath(path).strip():
        raise TrtspecError(f"{what} is empty: give a path")


def _check_common(path: PathLike, target: Path, inputs: Iterable[PathLike | None], replaced: bool = True) -> None:
    """Rules shared by every output: not an input, not inside an input (`protected_directories`)
    or another trtspec output, not holding an input when it is `replaced`, and a parent that
    exists (or can be created along the path as given) and is writable."""
    inputs = list(inputs)
    given = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    nearest = next(p for p in (given, *given.parents) if os.path.lexists(p))
    if nearest.is_symlink() and not nearest.exists() and not target.parent.is_dir():  # a dangling link
        raise TrtspecError(f"cannot write {path}: {nearest} is a symbolic link to {os.readlink(nearest)}, in a "
                           "directory that does not exist; create it, or give another path")
    for given, source in _inputs(inputs):
        if target == source:
            raise TrtspecError(f"refusing to write {path}: it is also an input ({given}); choose another output path")
        if replaced and source.is_relative_to(target):
            raise TrtspecError(f"refusing to replace {path}: it holds the input {given}; choose another output path")
    for parent in target.parents:
        kind = output_kind(parent) if parent.is_dir() else None
        if kind is not None:
            raise TrtspecError(f"refusing to write {path}: it is inside the {kind} {parent}, which trtspec "
                               "replaces as a whole; choose a path outside it")
    for directory, name in protected_directories(inputs):
        if target.is_relative_to(directory):
            raise TrtspecError(f"refusing to write {path}: it is inside {name}; choose a path outside it")
    existing = next(p for p in (target.parent, *target.parent.parents) if os.path.lexists(p))
    if not existing.is_dir():
        raise TrtspecError(f"cannot write {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise TrtspecError(f"cannot write {path}: {existing} is not writable")


def check_output_dir(path: PathLike, kind: str, inputs: Iterable[PathLike | None] = ()) -> Path:
    """Refuse, before any work, a directory output that would destroy something (module docstring);
    returns the resolved path."""
    check_named(path, f"the {kind} path")
    target = _resolved(path)
    cwd = _resolved(os.getcwd())
    if target == cwd or cwd.is_relative_to(target):
        raise TrtspecError(f"refusing to replace {path}: it is the current directory or one of its parents; "
                           "choose a new directory")
    _check_common(path, target, inputs)
    if os.path.lexists(target):
        if not target.is_dir():
            raise TrtspecError(f"refusing to replace {path}: it exists and is not a directory")
        found = output_kind(target)
        if found is not None and found != kind:
            raise TrtspecError(f"refusing to replace {path}: it is a trtspec {found}, not a {kind}; "
                               "choose another path")
        if found is None and any(target.iterdir()):
            raise TrtspecError(f"refusing to replace {path}: it is a non-empty directory that is not a previous "
                               f"trtspec {kind}; remove it yourself or choose another path")
        if not os.access(target.parent, os.W_OK | os.X_OK):
            raise TrtspecError(f"cannot replace {path}: {target.parent} is not writable")
    return target


def check_output_file(path: PathLike, inputs: Iterable[PathLike | None] = (), suffix: str | None = None,
                      what: str = "output") -> Path:
    """Refuse, before any work, a file output that cannot or must not be written; returns the
    resolved path (a symlink's target, so the link itself stays)."""
    check_named(path, f"the {what} path" if what == "output" else what)
    if suffix is not None and Path(path).suffix != suffix:
        raise TrtspecError(f"{what} is written as {suffix}; name it *{suffix}, not {Path(path).name}")
    target = _resolved(path)
    if os.path.lexists(target):
        if target.is_dir():
            raise TrtspecError(f"cannot write {path}: it is a directory; give a file path")
        if not stat.S_ISREG(target.stat().st_mode):
            raise TrtspecError(f"cannot write {path}: it is not a regular file (a device, pipe or socket); "
                               "give a file path")
        if not os.access(target, os.W_OK):
            raise TrtspecError(f"cannot write {path}: the file is not writable")
    _check_common(path, target, inputs)
    return target


def check_work_dir(path: PathLike, inputs: Iterable[PathLike | None] = (), what: str = "the work directory",
                   option: str = "--work") -> Path:
    """Refuse, before any work, a work directory (the checkpoints a restarted run resumes from, or
    another directory a run keeps for later ones) that is not a directory or breaks the rule for
    outputs; it is never replaced, so it may exist and may hold inputs. Returns the resolved path."""
    check_named(path, f"{what} path")
    target = _resolved(path)
    if os.path.lexists(target) and not target.is_dir():
        raise TrtspecError(f"cannot use {path} as {what}: it exists and is not a directory; "
                           f"give a directory ({option} DIR)")
    _check_common(path, target, inputs, replaced=False)
    return target


def check_distinct_outputs(*paths: PathLike | None) -> None:
    """Refuse two outputs of one command at the same path or one inside the other (`--json X
    --plot X`): writing the second would destroy the first."""
    given = [(p, _resolved(p)) for p in paths if p is not None]
    for number, (first, one) in enumerate(given):
        for second, other in given[number + 1:]:
            if one == other:
                named = f"{first} is" if str(first) == str(second) else f"{first} and {second} are"
                raise TrtspecError(f"{named} given for two outputs of this command; give each output its own path")
            if one.is_relative_to(other) or other.is_relative_to(one):
                inner, outer = (first, second) if one.is_relative_to(other) else (second, first)
                raise TrtspecError(f"the output {inner} is inside the output {outer}; give each its own place")


def _sibling_prefix(target: Path, tag: str) -> str:
    return f".{target.name}.{tag}."


def _owner_tag() -> str:
    """Host and process id, so a later run can tell whether the writer of a sibling is gone."""
    return f"{socket.gethostname().replace('.', '_')}.{os.getpid()}."


def remove_stale(target: Path) -> list[Path]:
    """Remove hidden siblings of `target` left by runs on this host whose process no longer exists."""
    removed, host = [], socket.gethostname().replace(".", "_")
    if not target.parent.is_dir():
        return removed
    prefixes = tuple(_sibling_prefix(target, tag) for tag in (STAGING, TEMPORARY, REPLACED))
    for sibling in target.parent.iterdir():
        if not sibling.name.startswith(prefixes):
            continue
        fields = sibling.name.split(".")  # "", name parts..., tag, host, pid, random
        try:
            owner_host, pid = fields[-3], int(fields[-2])
        except (IndexError, ValueError):
            continue
        if owner_host != host or _alive(pid):
            continue
        if sibling.is_dir() and not sibling.is_symlink():
            shutil.rmtree(sibling, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                sibling.unlink()
        removed.append(sibling)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Terminated(SystemExit):
    """SIGTERM (or SIGHUP) arrived while an output was being staged; exit status 128 + signal."""


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """While staging, turn SIGTERM/SIGHUP (whose default is to die on the spot) into an exception,
    so the cleanup of the `except` below runs; handlers someone else installed are kept."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def terminate(number, frame):
        if _importing(frame):  # an exception inside a native module's initialisation crashes the process
            threading.Timer(0.05, os.kill, (os.getpid(), number)).start()  # so: again once the import is done
            return
        raise Terminated(128 + number)

    for number in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(number) is signal.SIG_DFL:
            previous[number] = signal.signal(number, terminate)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _importing(frame) -> bool:
    """Whether Python is importing a module at this frame (e.g. onnx, lazily, during a build)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _write_marker(directory: Path, kind: str) -> None:
    from trtspec import __version__

    (directory / MARKER).write_text(json.dumps({"kind": kind, "trtspec_version": __version__}) + "\n",
                                    encoding="utf-8")


@contextlib.contextmanager
def staged_directory(path: PathLike, kind: str, inputs: Iterable[PathLike | None] = ()) -> Iterator[Path]:
    """Yield a hidden sibling directory to fill; on success it replaces `path` (checked with
    `check_output_dir`, at the start and again just before), on any error or signal it is deleted:
    `path` is either the old output or the complete new one."""
    inputs = list(inputs)
    target = check_output_dir(path, kind, inputs)
    with _signals_raise(), _write_errors(path):
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(target)
        staging = Path(tempfile.mkdtemp(prefix=_sibling_prefix(target, STAGING) + _owner_tag(), dir=target.parent))
        old = None
        try:
            yield staging
            _write_marker(staging, kind)
            _make_shareable(staging)
            check_output_dir(path, kind, inputs)
            if os.path.lexists(target):  # moved aside, not deleted, until the new output is in place
                old = Path(tempfile.mkdtemp(prefix=_sibling_prefix(target, REPLACED) + _owner_tag(),
                                            dir=target.parent))
                os.replace(target, old / "old")
            os.replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            if old is not None and (old / "old").exists() and not os.path.lexists(target):
                os.replace(old / "old", target)  # interrupted between the two renames: put the old one back
            raise
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_file(path: PathLike, inputs: Iterable[PathLike | None] = (), suffix: str | None = None,
                what: str = "output") -> Iterator[Path]:
    """Yield a uniquely named temporary sibling to write; on success it is renamed onto `path`
    (checked with `check_output_file`), on any error or signal it is deleted."""
    inputs = list(inputs)
    target = check_output_file(path, inputs, suffix, what)
    with _signals_raise(), _write_errors(path):
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(target)
        handle, name = tempfile.mkstemp(prefix=_sibling_prefix(target, TEMPORARY) + _owner_tag(), dir=target.parent)
        os.close(handle)
        temporary = Path(name)
        try:
            yield temporary
            _make_shareable(temporary)
            check_output_file(path, inputs, suffix, what)
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                temporary.unlink()
            raise


@contextlib.contextmanager
def _write_errors(path: PathLike) -> Iterator[None]:
    """A full disk, a quota, a read-only place: one line naming the output, not a traceback."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in WRITE_ERRORS:
            raise
        raise TrtspecError(f"cannot write {path}: {exc.strerror}") from None


def atomic_write_text(path: PathLike, text: str, inputs: Iterable[PathLike | None] = ()) -> Path:
    """Write `text` to `path` through `staged_file`; returns `path`."""
    with staged_file(path, inputs) as temporary:
        temporary.write_text(text, encoding="utf-8")
    return Path(path)


def _make_shareable(path: Path) -> None:
    """mkdtemp/mkstemp create private (0700/0600) entries; give them and their files the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    if path.is_file():
        path.chmod(0o666 & ~umask)
        return
    path.chmod(0o777 & ~umask)
    for entry in path.rglob("*"):
        entry.chmod((0o777 if entry.is_dir() else 0o666) & ~umask)


def stderr_line(line: str) -> None:
    """The default announcement of slow one-time work (a conversion, a timing): a line on stderr, now."""
    print(line, file=sys.stderr, flush=True)
