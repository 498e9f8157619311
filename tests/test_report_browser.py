"""The report page of a 4-IPU pipelined training program, opened in a real
headless Chromium: each IPU's section is rendered and nothing is wider than
the window.  The page measures itself when opened with ``#selftest`` (a
script in the page writes what it found into a hidden <div>), and Chromium's
``--dump-dom`` prints the DOM after the page has loaded.  Skips when no
Chromium is installed (``apt-get install chromium``)."""
import re
import shutil
import subprocess

import pytest
from four_ipu_model import compile_four_ipus

CHROMIUM = next((found for found in map(shutil.which, ("chromium", "chromium-browser",
                                                        "google-chrome")) if found), None)

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary found "
                                "(apt-get install chromium)")


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    compile_four_ipus(root)
    return root / "training" / "index.html", tmp_path_factory.mktemp("chromium-profile")


def _measure(page, width):
    html, profile = page
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--user-data-dir={profile}", "--dump-dom", f"--window-size={width},900",
         f"{html.as_uri()}#selftest"],
        capture_output=True, text=True, timeout=120)
    found = re.search(r'<div id="selftest"([^>]*)>', result.stdout)
    assert found, f"the page did not measure itself:\n{result.stderr[-2000:]}"
    return dict(re.findall(r'data-([\w-]+)="([^"]*)"', found.group(1))), result.stdout


@pytest.mark.parametrize("width", [1280, 800])
def test_every_ipu_is_rendered_and_nothing_overflows(page, width):
    measured, dom = _measure(page, width)
    assert int(measured["inner-width"]) == width
    assert int(measured["scroll-width"]) <= width, measured["overflowing"]
    assert measured["overflowing"] == ""
    assert int(measured["ipu-sections"]) == 4
    # every plot loaded: 4 memory plots, cycles, liveness, timeline
    assert int(measured["images"]) == 7 and measured["broken-images"] == ""
    for k in range(4):                # each section with its heading and category table
        section = re.search(rf'<section class="ipu" id="ipu-{k}".*?</section>', dom, re.S)
        assert section and f"IPU {k}: memory" in section.group(0)
        assert "not modelled" in section.group(0)
