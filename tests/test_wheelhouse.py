"""The GPU bundle's tools (scripts/wheelhouse.py): pieces of at most the size a transfer takes,
joined back byte for byte, a damaged or missing piece named, and a member cut out of a wheel with
its RECORD line."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("wheelhouse", REPO / "scripts" / "wheelhouse.py")
wheelhouse = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wheelhouse)


def test_the_user_chooses_the_piece_size(tmp_path):
    """`bundle --piece-mib`: pieces of at most the size the user's link takes."""
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "a.whl").write_bytes(os.urandom(300_000))
    ns = argparse.Namespace
    out = tmp_path / "pieces"
    assert wheelhouse.bundle(ns(src=str(tmp_path / "wheels"), out=str(out), piece_mib=0.1)) == 0
    pieces = sorted(out.glob("piece*"))
    assert len(pieces) == 3 and all(p.stat().st_size <= 0.1 * 2**20 for p in pieces)
    with pytest.raises(SystemExit, match="piece-mib"):
        wheelhouse.bundle(ns(src=str(tmp_path / "wheels"), out=str(out), piece_mib=0))


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_bundle_travels_in_pieces_and_comes_back_whole(tmp_path, monkeypatch):
    src = tmp_path / "wheels"
    (src / "sub").mkdir(parents=True)
    (src / "a.whl").write_bytes(os.urandom(250_000))
    (src / "sub" / "b.bin").write_bytes(os.urandom(90_000))
    monkeypatch.setattr(wheelhouse, "PIECE_BYTES", 100_000)
    ns = argparse.Namespace
    assert wheelhouse.bundle(ns(src=str(src), out=str(tmp_path / "pieces"))) == 0
    pieces = sorted((tmp_path / "pieces").glob("piece*"))
    assert len(pieces) == 4 and all(p.stat().st_size <= 100_000 for p in pieces)
    out = tmp_path / "back"
    assert wheelhouse.unbundle(ns(pieces=str(tmp_path / "pieces"), out=str(out))) == 0
    assert _tree(out) == _tree(src)
    # A flipped byte in one piece is named; nothing is unpacked.
    damaged = bytearray(pieces[2].read_bytes())
    damaged[10] ^= 0xFF
    pieces[2].write_bytes(bytes(damaged))
    with pytest.raises(SystemExit, match="piece02 is damaged"):
        wheelhouse.unbundle(ns(pieces=str(tmp_path / "pieces"), out=str(tmp_path / "again")))
    assert not (tmp_path / "again").exists() and not (tmp_path / "again.tar").exists()
    pieces[1].unlink()
    with pytest.raises(SystemExit, match="piece01 is missing"):
        wheelhouse.unbundle(ns(pieces=str(tmp_path / "pieces"), out=str(tmp_path / "again")))


def test_the_pieces_still_to_carry_are_named(tmp_path, monkeypatch, capsys):
    """Part-way through a carry, the pieces that have not arrived are named (and a bundle whose
    checksums did not travel is refused)."""
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "a.whl").write_bytes(os.urandom(250_000))
    monkeypatch.setattr(wheelhouse, "PIECE_BYTES", 100_000)
    ns = argparse.Namespace
    pieces = tmp_path / "pieces"
    wheelhouse.bundle(ns(src=str(tmp_path / "wheels"), out=str(pieces)))
    capsys.readouterr()
    (pieces / "piece00").unlink()
    (pieces / "piece02").unlink()
    assert wheelhouse.missing(ns(pieces=str(pieces))) == 0
    assert capsys.readouterr().out.strip() == "pieces here: 1 of 3; missing: piece00 piece02"
    (pieces / "SHA256SUMS").unlink()
    with pytest.raises(SystemExit, match="SHA256SUMS is missing"):
        wheelhouse.missing(ns(pieces=str(pieces)))


def test_a_member_is_cut_from_a_wheel_and_its_record(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr("pkg/big.so", b"x" * 1000)
        z.writestr("pkg-1.0.dist-info/RECORD", "pkg/__init__.py,,\npkg/big.so,sha256=x,1000\n")
    wheelhouse.strip_member(wheel, "pkg/big.so")
    with zipfile.ZipFile(wheel) as z:
        assert z.namelist() == ["pkg/__init__.py", "pkg-1.0.dist-info/RECORD"]
        assert "big.so" not in z.read("pkg-1.0.dist-info/RECORD").decode()
