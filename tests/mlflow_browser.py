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
from typing import Any

from runner.serving.vllm_server import free_port

# As root in a container, and on a machine whose network is closed: no sandbox, and none of
# Chromium's own connections (each refused, many at a time).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


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


# Where the run page's parts end on the screen: the page's width, and the right edge of the side
# panel's headings (about the run, datasets, registered models), null where one is not shown.
LAYOUT_JS = """() => {
  const edge = (label) => {
    const el = [...document.querySelectorAll('body *')].find(
      (e) => e.childElementCount === 0 && e.textContent.trim() === label);
    return el ? el.getBoundingClientRect().right : null;
  };
  return {width: document.documentElement.scrollWidth, about: edge('About this run'),
          datasets: edge('Datasets'), registered: edge('Registered models')};
}"""


def _dataset_drawer(page: Any, dataset: str) -> str:
    """The dataset `dataset` opened from the runs table: its drawer's text (rows, schema)."""
    page.get_by_role("button", name=f"{dataset} (").first.click()
    page.get_by_text("num rows").first.wait_for()
    text = page.inner_text("body")
    page.keyboard.press("Escape")
    return text


def _models_tab(page: Any) -> str:
    """The experiment's Models tab: the logged models of its runs, with their registry versions."""
    page.get_by_role("link", name="Models", exact=True).first.click()
    page.get_by_text("draft", exact=True).first.wait_for()
    text = page.inner_text("body")
    page.get_by_role("link", name="Runs", exact=True).first.click()
    return text


def browse_to_run(url: str, run_id: str, browser: str, dataset: str) -> dict[str, Any]:
    """From the home page, in a browser that has never chosen MLflow's view: Experiments,
    eagle3 (in the model-training view `eagle3-runner ui` opens it in), the dataset `dataset`'s
    drawer, the experiment's Models tab, then the run `run_id`: its Overview (and where its parts
    end on a 1600 px screen), its Model metrics and its artifacts. Returns the text each view
    shows, under "layout" the overview's edges, and under "view" the view the experiment opened
    in."""
    from playwright.sync_api import sync_playwright

    seen = {}
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=browser, args=CHROMIUM_ARGS)
        page = b.new_page(viewport={"width": 1600, "height": 1000})
        page.set_default_timeout(30_000)
        page.goto(url, wait_until="load")
        page.get_by_role("link", name="Experiments").first.click()
        page.get_by_role("link", name="eagle3").first.click()
        run_link = page.locator(f'a[href*="{run_id}"]').first
        run_link.wait_for()
        seen["view"] = page.evaluate("localStorage.getItem('mlflow.workflowType_v1')") or ""
        seen["experiment"] = page.inner_text("body")
        seen["dataset"] = _dataset_drawer(page, dataset)
        seen["models"] = _models_tab(page)
        run_link.click()
        page.get_by_text("acceptance length").first.wait_for()
        seen["overview"] = page.inner_text("body")
        # The figures after the summary in the description (MLflow shows its first lines, then
        # "Show more"), loaded: an image MLflow could not serve has no size.
        page.get_by_text("Show more").first.click()
        page.locator('img[src*="loss_curves.png"]').first.wait_for()
        figures = "[...document.images].filter(i => i.src.includes('get-artifact'))"
        page.wait_for_function(f"{figures}.every(i => i.complete)")
        seen["layout"] = page.evaluate(LAYOUT_JS)  # the description open, its figures loaded
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
