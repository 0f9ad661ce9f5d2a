"""Adapter to MLflow's SQLite schema (checked against MLflow 3.17): re-point an output root's
MLflow store after the root was copied or moved.

    moved = repoint(db_path, new_root)    # the old root, or None if the store was already here

MLflow records absolute locations: the experiment's artifact location, each run's artifact URI,
and the runner's own path tags (`path.<stage>`, `linked.*`). A copied root would keep writing
run artifacts into the original and reading artifacts from it; MLflow has no API to change an
experiment's artifact location or a run's artifact URI, so this updates the rows directly, in
one transaction. Tables and columns touched: experiments.artifact_location, runs.artifact_uri,
logged_models.artifact_location (where present) and tags.value for the runner's path tags.
Only the default store of a root (<root>/mlflow.db with artifacts in <root>/mlartifacts) is
touched: any other tracking URI is the user's to manage.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from urllib.parse import unquote, urlparse

ARTIFACTS = "mlartifacts"
# The runner's tags that hold paths under the root.
_PATH_TAGS = ("path.", "linked.")


def _old_root(location: str) -> Path | None:
    parsed = urlparse(location)
    if parsed.scheme not in ("", "file"):
        return None
    path = Path(unquote(parsed.path))
    return path.parent if path.name == ARTIFACTS else None


def _swap(con: sqlite3.Connection, table: str, column: str, old: str, new: str) -> int:
    """Rows of `table` whose `column` starts with `old`, rewritten to start with `new`."""
    cur = con.execute(
        # Table and column names are this module's own constants, never input.
        f"UPDATE {table} SET {column} = ? || substr({column}, ?) WHERE substr({column}, 1, ?) = ?",
        (new, len(old) + 1, len(old), old),
    )
    return cur.rowcount


def repoint(db: Path, new_root: Path) -> Path | None:
    """If the store at `db` was made for another root (it was copied or moved here), point its
    artifact locations and the runner's path tags at `new_root`; the old root, else None."""
    new_root = new_root.resolve()
    con = sqlite3.connect(db, timeout=30)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not {"experiments", "runs", "tags"} <= tables:
            return None
        olds = {
            root
            for (location,) in con.execute("SELECT artifact_location FROM experiments")
            if location and (root := _old_root(location)) is not None and root != new_root
        }
        if not olds:
            return None
        with con:  # one transaction: all rows re-pointed, or none
            for old in olds:
                for table, column, prefix_old, prefix_new in (
                    ("experiments", "artifact_location", old, new_root),
                    ("runs", "artifact_uri", old, new_root),
                    ("logged_models", "artifact_location", old, new_root),
                ):
                    if table not in tables:
                        continue
                    for form in (lambda p: p.as_uri(), str):  # file:///x and /x alike
                        _swap(con, table, column, form(prefix_old) + "/", form(prefix_new) + "/")
                for tag in _PATH_TAGS:
                    con.execute(
                        "UPDATE tags SET value = ? || substr(value, ?) "
                        "WHERE substr(key, 1, ?) = ? AND substr(value, 1, ?) = ?",
                        (
                            str(new_root) + "/",
                            len(str(old)) + 2,
                            len(tag),
                            tag,
                            len(str(old)) + 1,
                            str(old) + "/",
                        ),
                    )
        return sorted(olds)[0]
    finally:
        con.close()
