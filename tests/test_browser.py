"""The HTML reports in a real headless browser: they render, show their figures, run nothing.

Uses Debian's ``chromium`` and ``chromium-driver`` through Selenium, with the driver path
given explicitly so nothing is downloaded at run time. Skips only where no browser or
driver is installed.
"""

from __future__ import annotations

import io
import os
import shutil

import numpy as np
import pytest
import torch

import attnscope as a
from attnscope import Stage
from attnscope.checking.report import CheckReport, Failure, StageCheck

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.common.exceptions import NoAlertPresentException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

matplotlib_image = pytest.importorskip("matplotlib.image")

EVIL = "<script>alert(1)</script>"
CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
CHROMEDRIVER = shutil.which("chromedriver") or (
    "/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else None
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="no Chromium and chromedriver installed (Debian: apt install chromium chromium-driver)",
)
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--window-size=1280,1800",
]


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in [*ARGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SE_OFFLINE", "true")  # Selenium Manager must not fetch anything
        browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield browser
    browser.quit()


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reports")
    torch.manual_seed(123)
    labels = [EVIL, "journey", "starts", "with"]
    trace = a.CausalAttention(3, 2, 4, 0.0).trace(a.book_embeddings()[:4], labels=labels)
    trace.to_html(str(folder / "trace.html"))
    reference = trace["masked_scores"].double()
    observed = reference.masked_fill(torch.isinf(reference), -1e9)
    report = CheckReport(
        ok=False,
        kind="causal",
        target=f"evil.py:{EVIL}",
        first_failure=Failure(
            Stage.MASKED_SCORES, "mask_fill_value", f"the mask fills -1e9 {EVIL}", "evil.py:7"
        ),
        checks=[
            StageCheck(Stage.SCORES, True, "scores match", (4, 4), (4, 4)),
            StageCheck(
                Stage.MASKED_SCORES, False, "-1e9", (4, 4), (4, 4), "evil.py:7", reference, observed
            ),
        ],
    )
    report.to_html(str(folder / "check.html"))
    return folder


def _open(driver, path):
    driver.get_log("browser")  # drain the previous page's entries
    driver.get(path.as_uri())


def _assert_clean(driver):
    """No console errors, no alert, no script element: the escaped label ran nothing."""
    severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == []
    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text  # noqa: B018
    assert driver.find_elements(By.TAG_NAME, "script") == []


def _not_blank(png: bytes) -> None:
    pixels = matplotlib_image.imread(io.BytesIO(png), format="png")[..., :3]
    assert pixels.shape[0] > 10 and pixels.shape[1] > 10
    assert np.std(pixels) > 0.02


def _assert_visible_images(driver, css):
    images = driver.find_elements(By.CSS_SELECTOR, css)
    assert images
    for img in images:
        assert img.is_displayed()
        assert img.size["width"] > 100 and img.size["height"] > 100
        assert img.get_property("naturalWidth") > 0  # the data: URI decoded as a PNG
    return images


def test_trace_report_renders(driver, pages, tmp_path):
    _open(driver, pages / "trace.html")
    _assert_clean(driver)
    assert driver.title == "attnscope trace: CausalAttention (causal)"
    label = driver.find_elements(By.XPATH, "//code[normalize-space()='<script>alert(1)</script>']")
    assert label and label[0].is_displayed() and label[0].text == EVIL
    heatmaps = _assert_visible_images(driver, "img.heatmap")
    assert len(heatmaps) == 4
    _assert_visible_images(driver, "img.pipeline")
    rows = driver.find_elements(By.CSS_SELECTOR, "table.stages tr")
    assert len(rows) == 1 + len(driver.find_elements(By.CSS_SELECTOR, "table.stages .pass"))
    driver.save_screenshot(str(tmp_path / "trace.png"))
    _not_blank((tmp_path / "trace.png").read_bytes())
    _not_blank(heatmaps[0].screenshot_as_png)


def test_check_report_renders(driver, pages):
    _open(driver, pages / "check.html")
    _assert_clean(driver)
    failure = driver.find_element(By.ID, "first-failure")
    assert failure.is_displayed() and failure.size["height"] > 100
    assert "First failure: masked_scores" in failure.text
    assert f"the mask fills -1e9 {EVIL}" in failure.text
    assert "evil.py:7" in failure.text
    _not_blank(failure.screenshot_as_png)
    _assert_visible_images(driver, "#first-failure img.heatmap")
    tables = failure.find_elements(By.CSS_SELECTOR, "table.matrix")
    assert len(tables) == 3 and all(t.is_displayed() for t in tables)
    assert EVIL in driver.find_element(By.TAG_NAME, "h1").text


def test_model_report_renders_the_decoding_column(driver, tmp_path):
    """A model's layers x stages grid with its decoding column, and the decoding failure's
    message and line below it."""
    from conftest import GALLERY

    page = tmp_path / "model.html"
    target = GALLERY / "models" / "buggy_cache_mask_first_rows.py"
    a.check(f"{target}:make_model").to_html(str(page))
    _open(driver, page)
    _assert_clean(driver)
    header = [th.text for th in driver.find_elements(By.CSS_SELECTOR, "table tr:first-child th")]
    assert header[-1] == "decoding" and "masked_scores" in header
    cells = driver.find_elements(By.CSS_SELECTOR, "td.decode")
    assert [c.text for c in cells] == ["✗ step 0 cache_mask", "not reached"]
    assert all(c.is_displayed() for c in cells)
    section = driver.find_element(By.ID, "decode")
    assert section.is_displayed() and section.size["height"] > 60
    assert "Decoding with its cache: cache_mask" in section.text
    assert "buggy_cache_mask_first_rows.py:" in section.text
    _not_blank(section.screenshot_as_png)
