"""The vLLM backend's file check (stages/extract/vllm_backend.py), run while the requests are
still out: one thread reads, checks and summarises each row's hidden-state file as soon as it has
landed, so that the check overlaps the requests instead of following them. On one H200 the check
after the requests took 4.5 s alone for 1,500 rows (the requests 4.4 s), and 194 s with other
work on the cores (docs/benchmarks.md, one H200, 2026-12-04), all of it after the client had ended.

The thread walks the rows in order (the statistics add up in the same order as a check after the
requests would, so they do not change from run to run), each once its file is there: present
before the requests (a resumed run) or reported by the client (`ready`). Per file: speculators'
own check (token ids, length, finite values), the slot count and dtype, the layer statistics,
and with extract.storage=fp8 the quantized copy written into the artifact.

    check = FileCheck(rows, done_dir, stats, slots=4, dtype=torch.bfloat16, fp8_into=None)
    check.ready(i)             # from the client, as each file lands
    waited_s = check.finish()  # after the requests: the rest; check.error names a bad file
    check.close()              # the stage failed: stop at the next file
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runner.core.errors import StageError
from stages.extract.samples import LayerStats, write_sample


class FileCheck:
    """The check of every row's file on a thread of its own, started at once."""

    def __init__(
        self,
        rows: Sequence[Any],
        done_dir: Path,
        stats: LayerStats,
        slots: int,
        dtype: Any,
        fp8_into: Path | None = None,
    ) -> None:
        self.rows, self.done_dir, self.stats = rows, done_dir, stats
        self.slots, self.dtype, self.fp8_into = slots, dtype, fp8_into
        self._landed = [self._path(i).exists() for i in range(len(rows))]
        self._cond = threading.Condition()
        self._ended = False  # no more files will land: the requests are over
        self._stop = False  # the stage failed: check no further
        self.checked = 0
        self.busy_s = 0.0  # the thread's own time reading and checking
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="extract-file-check", daemon=True)
        self._thread.start()

    def _path(self, i: int) -> Path:
        return self.done_dir / f"hs_{i}.safetensors"

    def ready(self, i: int) -> None:
        """Row i's file has landed in done_dir."""
        with self._cond:
            self._landed[i] = True
            self._cond.notify()

    def _run(self) -> None:
        for i in range(len(self.rows)):
            with self._cond:
                while not self._landed[i] and not self._ended:
                    self._cond.wait()
                if not self._landed[i] or self._stop:
                    return  # never came (the stage reports the missing rows), or it failed
            t = time.perf_counter()
            try:
                self._one(i)
            except StageError as exc:
                self.error = str(exc)
                return
            except Exception as exc:  # an unreadable file: the stage's own check names it
                self.error = f"the vLLM hidden states for sample {i} could not be read ({exc})"
                return
            finally:
                self.busy_s += time.perf_counter() - t
            self.checked += 1

    def _one(self, i: int) -> None:
        from safetensors.torch import load_file
        from speculators.data_generation.offline import check_hidden_states

        path, ids = self._path(i), self.rows[i]
        data = load_file(str(path))
        try:
            check_hidden_states(data, ids.tolist())
        except ValueError as exc:
            path.unlink()
            raise StageError(
                f"vLLM hidden states for sample {i} are invalid ({exc}); the file was removed, "
                "a re-run redoes it"
            ) from None
        hs = data["hidden_states"]
        if hs.shape[1] != self.slots or hs.dtype != self.dtype:
            raise StageError(
                f"vLLM hidden states for sample {i} have shape {tuple(hs.shape)} {hs.dtype}; "
                f"expected {self.slots} slots in {self.dtype}"
            )
        self.stats.update_batch(hs[None], [hs.shape[0]])
        if self.fp8_into is not None:  # quantized after the statistics saw the full values
            write_sample(self.fp8_into / path.name, hs, ids, "fp8")

    def finish(self) -> float:
        """After the requests: checks what is left and waits for it. Returns the seconds waited
        (the check's time after the client); `error` then names the first bad file, if any."""
        t = time.time()
        with self._cond:
            self._ended = True
            self._cond.notify()
        self._thread.join()
        return time.time() - t

    def close(self) -> None:
        """The stage failed: the thread stops before its next file."""
        with self._cond:
            self._ended = self._stop = True
            self._cond.notify()
        self._thread.join()
