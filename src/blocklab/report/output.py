"""Where the report writes: `SWEEP/report` by default, or the folder `--out DIR` names. Every file goes through
blocklab.folder, checked from a root the report trusts (the sweep folder, whose `report/` may be a planted link, or
the user's --out folder): no link below the root is followed, and each file is written to a new temporary, then
renamed into place."""
import os
from dataclasses import dataclass
from pathlib import Path

from blocklab import folder

# The files of every report (figures are named by the studies and benchmarks they show).
FIXED_FILES = ("index.html", "summary.csv")


@dataclass(frozen=True)
class Out:
    root: Path  # the folder paths are checked from
    sub: Path = Path(".")  # the report's folder below it

    @classmethod
    def of(cls, out: "Out | Path") -> "Out":
        """A plain Path (a test's folder): that folder is the root."""
        return out if isinstance(out, Out) else cls(Path(out))

    @classmethod
    def for_sweep(cls, sweep_dir: Path, out_dir: Path | None = None) -> "Out":
        """SWEEP/report, checked from the sweep folder, or the user's --out DIR, checked from itself."""
        return cls(Path(sweep_dir), Path("report")) if out_dir is None else cls(Path(out_dir))

    @property
    def path(self) -> Path:
        return self.root / self.sub

    def check(self) -> None:
        """FolderError (one line) where the report folder, or one of its fixed files, is a link or not what it
        should be: before any work is done. In a sweep folder's report/ (not the user's --out folder), anything
        there that is not a file or folder (a link planted at a figure's name) is refused too."""
        report = folder.check(self.root, self.sub, "dir")
        for name in FIXED_FILES:
            folder.check(self.root, self.sub / name, "file")
        if self.sub != Path(".") and report.is_dir():
            for entry in sorted(os.listdir(report)):
                folder.check(self.root, self.sub / entry)

    def unwritable(self) -> Path | None:
        """The folder that stops the report from being written (read-only, or not ours), None where none does: the
        report folder if it exists, else the nearest folder above it that does."""
        target = self.path
        while not target.exists() and target.parent != target:
            target = target.parent
        return None if os.access(target, os.W_OK | os.X_OK) else target

    def make(self) -> Path:
        return folder.make_dirs(self.root, self.sub)

    def write_bytes(self, name: str, data: bytes) -> Path:
        return folder.write_bytes(self.root, self.sub / name, data)

    def write_text(self, name: str, text: str) -> Path:
        return folder.write_text(self.root, self.sub / name, text)
