"""The I/O floor of a merge on the llm_scale set: read every input file once, write one model once.

No arithmetic: each input's ``*.safetensors`` files are read in 64 MiB blocks (as a merge must read them),
then the base folder's files are copied to ``--out`` (one model's bytes written, and a folder that loads).
Its wall time and peak memory are what no merge of these inputs can beat on this machine.

    python benchmarks/merging/llm_floor.py --base B --expert E1 --expert E2 --out OUT
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

BLOCK = 64 << 20


def read_all(folder: Path) -> int:
    n = 0
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as h:
            while block := h.read(BLOCK):
                n += len(block)
    return n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=Path, required=True)
    p.add_argument("--expert", type=Path, action="append", default=[])
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    read = sum(read_all(d) for d in [*a.expert, a.base])
    a.out.mkdir(parents=True, exist_ok=False)
    for f in sorted(a.base.iterdir()):
        if f.is_file():
            shutil.copyfile(f, a.out / f.name)
    print(f"read {read / 2**30:.2f} GiB, wrote {sum(f.stat().st_size for f in a.out.iterdir()) / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
