"""The watch page in headless Chromium driven by Selenium (the optional `browser` extra, and a
`chromium` + `chromedriver` on the PATH): a screenshot while the tokens stream in."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

# Where Debian's `chromium` and `chromium-driver` packages put them, and other names they go by.
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVERS = ("chromedriver",)


def find_chromium() -> tuple[str, str] | None:
    """(browser, driver) executables on the PATH; None where either is missing."""
    browser = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    driver = next((path for name in DRIVERS if (path := shutil.which(name))), None)
    return (browser, driver) if browser and driver else None


def screenshot_mid_generation(
    url: str, prompt: str, out: Path, min_tokens: int = 8, timeout_s: float = 300.0, size: tuple[int, int] = (1400, 900)
) -> dict[str, int]:
    """Open the watch page at `url`, submit `prompt`, and save a PNG to `out` once the target alone's
    pane holds `min_tokens` tokens or is done; return the tokens each pane held and `done` (1 or 0)."""
    from selenium import webdriver  # the optional `browser` extra
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    found = find_chromium()
    if found is None:
        raise RuntimeError(f"no Chromium ({'/'.join(BROWSERS)}) and chromedriver on the PATH")
    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.add_argument(f"--window-size={size[0]},{size[1]}")
    driver = webdriver.Chrome(service=Service(executable_path=found[1]), options=options)
    try:
        driver.get(url)
        driver.find_element(By.ID, "prompt").send_keys(prompt)
        driver.find_element(By.ID, "go").click()
        deadline = time.monotonic() + timeout_s
        count = {"spec": 0, "target": 0}
        # until enough of the target's tokens are in, or (a short answer) the target alone is done
        while count["target"] < min_tokens and not driver.find_element(By.ID, "target-done").text:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the page showed {count} tokens after {timeout_s:.0f} s")
            time.sleep(0.02)
            count = {pane: len(driver.find_elements(By.CSS_SELECTOR, f"#{pane} span")) for pane in count}
        out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(out))
        return count | {"done": int(bool(driver.find_element(By.ID, "target-done").text))}
    finally:
        driver.quit()
