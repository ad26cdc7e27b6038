"""The README's figures that scripts own are the scripts' output: the memory table and the 22 GB example
(scripts/memory_table.py) must equal the README's block between its markers."""
from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_memory_block_is_what_the_script_prints():
    script = runpy.run_path(str(ROOT / "scripts" / "memory_table.py"))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    begin, end = script["BEGIN"], script["END"]
    assert readme.count(begin) == 1 and readme.count(end) == 1
    block = readme[readme.index(begin):readme.index(end) + len(end)]
    assert block == script["readme_block"](), "README drifted: paste `python scripts/memory_table.py` between its markers"
