"""The MLflow UI as a user meets it, driven in Chromium through Playwright (the `browser` extra):
a server on a run's store, then the clicks a user makes from the home page to a finished run's
acceptance, loss chart and per-prompt table. Used by the e2e lane's browser test; skipped where
Playwright or a Chromium is missing."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from runner.serving.vllm_server import free_port


def chromium() -> str | None:
    """A Chromium to drive: Playwright's own (`playwright install chromium`), else the system's;
    None where there is neither (or Playwright is not installed)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    with sync_playwright() as p:
        own = Path(p.chromium.executable_path)
    if own.is_file():
        return str(own)
    return shutil.which("chromium") or shutil.which("chromium-browser")


@contextlib.contextmanager
def mlflow_ui(root: Path) -> Iterator[str]:
    """`eagle3-runner ui` on an output root's store (as the run's summary prints it), its
    address once it answers; stopped after."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "ui", "--output-root", str(root), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its MLflow server's workers stop with it (killpg below)
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"mlflow server did not answer at {url}") from None
                time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def browse_to_run(url: str, run_name: str, browser: str) -> dict[str, str]:
    """From the home page, in a browser that has never chosen MLflow's view: Experiments,
    eagle3, the run (in the model-training view `eagle3-runner ui` opens it in); then its
    Overview, its Model metrics and its artifacts. Returns the text each view shows, and under
    "view" the view the experiment opened in."""
    from playwright.sync_api import sync_playwright

    seen = {}
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=browser, args=["--no-sandbox"])
        page = b.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(30_000)
        page.goto(url, wait_until="load")
        page.get_by_role("link", name="Experiments").first.click()
        page.get_by_role("link", name="eagle3").first.click()
        page.get_by_role("link", name=run_name).first.wait_for()
        seen["view"] = page.evaluate("localStorage.getItem('mlflow.workflowType_v1')") or ""
        seen["experiment"] = page.inner_text("body")
        page.get_by_role("link", name=run_name).first.click()
        page.get_by_text("acceptance length").first.wait_for()
        seen["overview"] = page.inner_text("body")
        # The figures after the summary in the description (MLflow shows its first lines, then
        # "Show more"), loaded: an image MLflow could not serve has no size.
        page.get_by_text("Show more").first.click()
        page.locator('img[src*="loss_curves.png"]').first.wait_for()
        figures = "[...document.images].filter(i => i.src.includes('get-artifact'))"
        page.wait_for_function(f"{figures}.every(i => i.complete)")
        seen["figures"] = "\n".join(
            page.evaluate(
                f"{figures}.filter(i => i.naturalWidth > 0)"
                ".map(i => new URL(i.src).searchParams.get('path'))"
            )
        )
        page.get_by_role("tab", name="Model metrics").click()
        page.get_by_placeholder("Search metric charts").fill("train/loss")
        page.get_by_text("(train/loss)").first.wait_for()
        seen["metrics"] = page.inner_text("body")
        page.get_by_role("tab", name="Artifacts").click()
        page.get_by_text("evaluate", exact=True).first.click()
        page.get_by_text("prompts.json").first.wait_for()
        seen["artifacts"] = page.inner_text("body")
        b.close()
    return seen
