"""Packs side by side (study.pack_seeds under joblib's workers): which job trains which seed.

Every seed is trained by exactly one job. Locks are fcntl.flock locks on files in the sweep's `.pack_locks`
folder, which the operating system releases when the process holding them ends, so a killed job leaves none behind:
- the group lock (one per seed group): the job holding it forms its group's pack;
- a seed's lock: held by the job training that seed, from when it is chosen until its results are written;
- a seed's claim mark, written once the pack is formed: the seed's own job, finding its seed locked and
  marked, returns at once (the pack beside it trains it) and its worker takes the next job.
The group lock is released once the pack is formed, so a seed of the group that was not free (it resumes from
another step, or a job trains it alone) forms a pack of its own. A pack that cannot form (the model cannot be
packed) releases everything but its own seed, which then trains alone, and so do the others, each in its own job."""
import hashlib
import os
import time
from pathlib import Path

LOCKS = ".pack_locks"
POLL_S = 0.05


class Lock:
    """An exclusive flock on `path`, taken without waiting."""

    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def take(self) -> bool:
        import fcntl  # POSIX: imported here so that importing a run does not need it

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd = fd
        return True

    def release(self) -> None:
        import fcntl

        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _key(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()[:20]  # a job's folder name may be near the file system's limit


class Seed:
    """One seed's lock and claim mark; `run_dir` is the seed's job directory."""

    def __init__(self, run_dir: Path):
        folder = Path(run_dir).parent / LOCKS
        self.lock = Lock(folder / f"{_key(Path(run_dir).name)}.lock")
        self.mark_path = folder / f"{_key(Path(run_dir).name)}.claimed"

    def take(self) -> bool:
        if not self.lock.take():
            return False
        self.mark_path.unlink(missing_ok=True)  # left by a job that was killed: its lock went with it
        return True

    def mark(self, by: str) -> None:
        self.mark_path.write_text(by)

    def claimed_by(self) -> str | None:
        """Who trains this seed in a pack, if a live job does."""
        try:
            by = self.mark_path.read_text()
        except FileNotFoundError:
            return None
        if self.lock.take():  # the mark outlived its job
            self.release()
            return None
        return by

    def release(self) -> None:
        """Give the seed up, if this handle holds it: a mark written by the job that does stays."""
        if self.lock.fd is not None:
            self.mark_path.unlink(missing_ok=True)
            self.lock.release()


def group_lock(run_dir: Path, group: str) -> Lock:
    """The lock of a seed group, named by what its jobs share (their overrides but the seed)."""
    return Lock(Path(run_dir).parent / LOCKS / f"group-{_key(group)}.lock")


class Claims:
    """What a job forming a pack holds: its group's lock, its own seed and the other seeds it took."""

    def __init__(self, mine: Seed, group: Lock):
        self.mine, self.group, self.others = mine, group, {}

    def take(self, run_dir: Path) -> bool:
        seed = Seed(run_dir)
        if not seed.take():
            return False
        self.others[Path(run_dir)] = seed
        return True

    def give_back(self, run_dir: Path) -> None:
        self.others.pop(Path(run_dir)).release()

    def formed(self, by: str) -> None:
        """The pack of the seeds taken is formed: their jobs may return, and the group's lock is free."""
        for seed in self.others.values():
            seed.mark(by)
        self.group.release()

    def alone(self) -> None:
        """No pack: the other seeds go back to their own jobs; this job keeps its own seed while it trains it."""
        for run_dir in list(self.others):
            self.give_back(run_dir)
        self.group.release()

    def release(self) -> None:
        self.alone()
        self.mine.release()


def wait_for_turn(mine: Seed, group: Lock) -> str | None:
    """Wait until this job may form its group's pack (it then holds `group`; None), or until a pack beside it has
    claimed its seed (returns who)."""
    while True:
        if by := mine.claimed_by():
            return by
        if group.take():
            return None
        time.sleep(POLL_S)
