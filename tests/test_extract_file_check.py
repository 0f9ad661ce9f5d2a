"""The vLLM backend's file check (stages/extract/file_check.py) on files written here: it reads
each row's file as it lands, in row order, and says which file is bad.
Run: pytest tests/test_extract_file_check.py
"""

from __future__ import annotations

import threading

import torch

from stages.extract.file_check import FileCheck
from stages.extract.samples import LayerStats, write_sample

IDS = (1, 2, 3)


def _rows(n: int) -> list[torch.Tensor]:
    return [torch.arange(5 + i) for i in range(n)]


def _write(d, i: int, row: torch.Tensor, bad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    hs = torch.randn(len(row), len(IDS), 8, generator=g).to(torch.bfloat16)
    if bad:
        hs[0, 0, 0] = float("nan")
    write_sample(d / f"hs_{i}.safetensors", hs, row)
    return hs


def test_files_checked_as_they_land_add_up_as_one_pass_after_them(tmp_path):
    rows = _rows(6)
    states = [_write(tmp_path, 0, rows[0])]  # present before the requests (a resumed run)
    stats = LayerStats(IDS)
    check = FileCheck(rows, tmp_path, stats, len(IDS), torch.bfloat16)
    # The others land out of order, from another thread (the client's callbacks).
    order = [3, 1, 2, 5, 4]

    def client() -> None:
        for i in order:
            states.append(_write(tmp_path, i, rows[i]))
            check.ready(i)

    t = threading.Thread(target=client)
    t.start()
    t.join()
    assert check.finish() >= 0 and check.error is None and check.checked == 6
    # The same statistics as one pass over the files in row order.
    by_row = dict(zip([0, *order], states, strict=True))
    once = LayerStats(IDS)
    for i in range(6):
        once.update_batch(by_row[i][None], [len(rows[i])])
    assert stats.as_dict() == once.as_dict()


def test_a_bad_file_is_named_and_removed_and_a_missing_one_does_not_hang(tmp_path):
    rows = _rows(4)
    _write(tmp_path, 0, rows[0])
    _write(tmp_path, 1, rows[1], bad=True)
    check = FileCheck(rows, tmp_path, LayerStats(IDS), len(IDS), torch.bfloat16)
    check.finish()
    assert "sample 1 are invalid" in check.error and "non-finite" in check.error
    assert not (tmp_path / "hs_1.safetensors").exists()  # a re-run requests it again
    # Row 0 checked, row 2 never landed: finish returns, the stage names the missing rows.
    assert check.checked == 1
    wrong = FileCheck(rows[:1], tmp_path, LayerStats(IDS), len(IDS) + 1, torch.bfloat16)
    wrong.finish()
    assert "expected 4 slots" in wrong.error


def test_fp8_copies_are_written_from_the_full_values_and_close_stops_early(tmp_path):
    from safetensors.torch import load_file

    rows = _rows(3)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(), dst.mkdir()
    for i in range(2):
        _write(src, i, rows[i])
    check = FileCheck(rows, src, LayerStats(IDS), len(IDS), torch.bfloat16, fp8_into=dst)
    check.close()  # the stage failed: the thread ends without waiting for row 2
    assert check.checked <= 2 and not (dst / "hs_2.safetensors").exists()
    done = FileCheck(rows[:2], src, LayerStats(IDS), len(IDS), torch.bfloat16, fp8_into=dst)
    done.finish()
    got = load_file(str(dst / "hs_1.safetensors"))
    assert got["hidden_states"].dtype == torch.float8_e4m3fn
    assert torch.equal(got["token_ids"], rows[1])


def test_an_unreadable_file_is_an_error_not_a_crash(tmp_path):
    rows = _rows(1)
    (tmp_path / "hs_0.safetensors").write_bytes(b"not a safetensors file")
    check = FileCheck(rows, tmp_path, LayerStats(IDS), len(IDS), torch.bfloat16)
    check.finish()
    assert "sample 0 could not be read" in check.error and check.checked == 0
