"""The disk tier's index: which blocks are on disk, their sizes and when each was last used, in SQLite.

One index per tier folder, shared by every process that uses the folder (the engine cores of one host
under -dp read it, their workers write it): a block saved by one engine is found by the others at once.
SQLite's locking keeps the writers apart; in WAL mode a reader never waits for a writer. The total size
is kept by triggers, so the bound is checked in O(1). Eviction takes the least recently used blocks
(lru: last load or save) or the oldest saves (fifo); the workers delete the files of what it returns.
":memory:" gives a private index with no files (the simulator's).
"""

import sqlite3
from collections.abc import Iterable, Sequence

_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (key BLOB PRIMARY KEY, size INTEGER NOT NULL, ctime REAL NOT NULL,
                                   atime REAL NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS blocks_atime ON blocks (atime);
CREATE INDEX IF NOT EXISTS blocks_ctime ON blocks (ctime);
CREATE TABLE IF NOT EXISTS total (id INTEGER PRIMARY KEY CHECK (id = 0), bytes INTEGER NOT NULL);
INSERT OR IGNORE INTO total VALUES (0, 0);
CREATE TRIGGER IF NOT EXISTS blocks_add AFTER INSERT ON blocks
  BEGIN UPDATE total SET bytes = bytes + NEW.size; END;
CREATE TRIGGER IF NOT EXISTS blocks_drop AFTER DELETE ON blocks
  BEGIN UPDATE total SET bytes = bytes - OLD.size; END;
"""
_CHUNK = 500  # keys per IN (...) query
ORDER_COLUMN = {"lru": "atime", "fifo": "ctime"}


class BlockIndex:
    def __init__(self, path: str, eviction: str = "lru") -> None:
        if eviction not in ORDER_COLUMN:
            raise ValueError(f"unknown disk tier eviction policy {eviction!r}; choose from {sorted(ORDER_COLUMN)}")
        self._order = ORDER_COLUMN[eviction]
        self.db = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
        if path != ":memory:":
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)  # every statement is idempotent: processes sharing the folder may race here

    def _write(self) -> "_Transaction":
        return _Transaction(self.db)

    def present(self, keys: Sequence[bytes]) -> set[bytes]:
        found: set[bytes] = set()
        for i in range(0, len(keys), _CHUNK):
            chunk = keys[i : i + _CHUNK]
            marks = ",".join("?" * len(chunk))
            found.update(row[0] for row in self.db.execute(f"SELECT key FROM blocks WHERE key IN ({marks})", chunk))
        return found

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many of keys, from the first, are in the index."""
        n = 0
        for i in range(0, len(keys), _CHUNK):
            chunk = keys[i : i + _CHUNK]
            found = self.present(chunk)
            for key in chunk:
                if key not in found:
                    return n
                n += 1
        return n

    def add(self, entries: Iterable[tuple[bytes, int]], now: float) -> None:
        """Blocks just written (key, size); one already there is replaced (same key: same content)."""
        rows = [(key, size, now, now) for key, size in entries]
        with self._write():
            self.db.executemany("DELETE FROM blocks WHERE key = ?", [(r[0],) for r in rows])
            self.db.executemany("INSERT INTO blocks VALUES (?, ?, ?, ?)", rows)

    def touch(self, keys: Iterable[bytes], now: float) -> None:
        """Blocks just used (loaded): the most recent for lru."""
        with self._write():
            self.db.executemany("UPDATE blocks SET atime = ? WHERE key = ?", [(now, key) for key in keys])

    def remove(self, keys: Iterable[bytes]) -> None:
        with self._write():
            self.db.executemany("DELETE FROM blocks WHERE key = ?", [(key,) for key in keys])

    def total_bytes(self) -> int:
        return int(self.db.execute("SELECT bytes FROM total").fetchone()[0])

    def __len__(self) -> int:
        return int(self.db.execute("SELECT count(*) FROM blocks").fetchone()[0])

    def evict(self, budget: int) -> list[bytes]:
        """Drop blocks in eviction order until the total is within budget; their keys (the caller removes files)."""
        with self._write():
            dropped = self.first_to_go(self.total_bytes() - budget)
            self.db.executemany("DELETE FROM blocks WHERE key = ?", [(key,) for key in dropped])
        return dropped

    def first_to_go(self, nbytes: int) -> list[bytes]:
        """The first blocks in eviction order that together hold at least nbytes (all, if the tier holds less)."""
        dropped: list[bytes] = []
        while nbytes > 0:
            rows = self.db.execute(f"SELECT key, size FROM blocks ORDER BY {self._order} LIMIT 256 OFFSET ?",
                                   (len(dropped),)).fetchall()
            if not rows:
                break
            for key, size in rows:
                if nbytes <= 0:
                    break
                dropped.append(key)
                nbytes -= size
        return dropped

    def reconcile(self, files: Iterable[tuple[bytes, int, float]]) -> None:
        """Make the index list exactly these files (key, size, modification time): the start-up rebuild."""
        with self._write():
            self.db.execute("CREATE TEMP TABLE IF NOT EXISTS scanned (key BLOB PRIMARY KEY, size INTEGER, t REAL)")
            self.db.execute("DELETE FROM scanned")
            self.db.executemany("INSERT OR REPLACE INTO scanned VALUES (?, ?, ?)", files)
            self.db.execute("DELETE FROM blocks WHERE key NOT IN (SELECT key FROM scanned)")
            self.db.execute("DELETE FROM blocks WHERE key IN (SELECT s.key FROM scanned s JOIN blocks b "
                            "ON s.key = b.key WHERE s.size != b.size)")
            self.db.execute("INSERT OR IGNORE INTO blocks SELECT key, size, t, t FROM scanned")
            self.db.execute("DELETE FROM scanned")

    def shrink_log(self) -> None:
        """Write the WAL back into the database and truncate it: room on a full file system (it only grows between
        checkpoints, every 1000 pages by default)."""
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        self.db.close()


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on an error): writers of the shared folder take turns."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self.db.execute("ROLLBACK" if exc_type is not None else "COMMIT")
