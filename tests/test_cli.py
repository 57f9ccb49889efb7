"""Start-up errors end the process with one line that says what to fix."""
import subprocess
import sys

import pytest

CASES = [
    (["--page-size", "0"], "--page-size must be at least 1"),
    (["--max-running-requests", "0"], "--max-running-requests must be at least 1"),
    (["--model", "/nonexistent/model-dir"], "does not exist"),
    (["--dtype", "float64"], "invalid choice"),
]


@pytest.mark.parametrize("args,words", CASES)
def test_bad_startup_flags_fail_with_one_clear_line(args, words):
    proc = subprocess.run([sys.executable, "-m", "kvrelay", "serve", "--port", "0", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert words in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_lists_flags_from_the_config():
    out = subprocess.run([sys.executable, "-m", "kvrelay", "serve", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    for flag in ("--model", "--dtype", "--page-size", "--max-kv-tokens", "--kv-cache-gb",
                 "--max-prefill-tokens", "--max-running-requests", "--host", "--port"):
        assert flag in out
