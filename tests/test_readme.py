"""README.md's Use example runs as written and says what happened."""

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).parents[1] / "README.md"


def test_use_example_runs_and_says_what_happened(tmp_path):
    code = re.search(r"^## Use\n\n```python\n(.*?)^```", README.read_text(), re.M | re.S).group(1)
    (tmp_path / "example.py").write_text(code)
    out = subprocess.run([sys.executable, "example.py"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), "the example prints nothing on success"
