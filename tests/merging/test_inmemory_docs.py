"""docs/python_api.md runs as written: its python blocks, in order, in an empty folder, print what their
comments say."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "python_api.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)


def test_python_api_page_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = blocks()
    assert len(code) >= 4
    expected = [m.group(1).strip() for block in code for m in re.finditer(r"^print\(.*\)\s+#\s*(.+)$", block,
                                                                         flags=re.MULTILINE)]
    out = io.StringIO()
    namespace: dict = {}
    with contextlib.redirect_stdout(out):
        for block in code:
            exec(compile(block, str(PAGE), "exec"), namespace)  # noqa: S102 (the page's own examples)
    assert out.getvalue().splitlines() == expected
    assert (tmp_path / "merged-model" / "config.json").is_file()
    assert set(namespace["model"].peft_config) == {"math", "code", "merged", "merged-exact"}
