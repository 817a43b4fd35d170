"""The output of a merge: a complete model folder (or one safetensors file), built aside and renamed at the end.

:func:`check_out` refuses an unsafe ``--out`` before any work: one that names an input or lies inside one,
an existing non-empty folder or an existing file (unless ``overwrite``), a file suffix other than
``.safetensors``. :class:`OutputTarget` builds everything in a temporary sibling folder and renames it into
place only when the merge succeeded; on any failure the temporary folder is removed, so nothing is left.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..errors import OutputError
from ..utils.outpaths import check_writable

__all__ = ["TOKENIZER_FILES", "InputHashes", "OutputTarget", "check_out", "copy_model_files", "write_model_card"]

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.txt", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "preprocessor_config.json", "processor_config.json", "spiece.model"]


def _input_paths(sources: Iterable[Any]) -> list[Path]:
    paths = []
    for s in sources:
        folder = getattr(s, "folder", None)
        paths += [Path(folder)] if folder is not None else []
        paths += [Path(f) for f in getattr(s, "files", [])]
    return [p.resolve() for p in paths]


def check_out(out: Path, sources: Iterable[Any], *, overwrite: bool = False) -> str:
    """Refuse an unsafe ``out`` before any work; returns ``"file"`` (``X.safetensors``) or ``"folder"``.

    Raises:
        OutputError: one line naming ``out`` and what is wrong with it (exit code 5).
    """
    out = Path(out)
    real = out.resolve()
    for p in _input_paths(sources):
        if real == p or real.is_relative_to(p) or (p.is_relative_to(real) and real.exists()):
            raise OutputError(f"--out {out}: overlaps the input {p}; choose another path "
                              "(inputs are never overwritten)")
    if out.suffix and out.suffix != ".safetensors" and not out.is_dir():
        raise OutputError(f"--out {out}: unsupported file suffix {out.suffix!r} (clmerge writes safetensors); give "
                          f"a folder or {out.with_suffix('.safetensors').name}")
    kind = "file" if out.suffix == ".safetensors" else "folder"
    if kind == "file" and out.is_dir():
        raise OutputError(f"--out {out}: is a folder; give a new folder path or a .safetensors file name")
    if kind == "folder" and out.exists() and not out.is_dir():
        raise OutputError(f"--out {out}: exists and is not a folder")
    if not overwrite and out.exists() and (kind == "file" or any(out.iterdir())):
        raise OutputError(f"--out {out}: already exists and is not empty (pass --overwrite to replace it)")
    check_writable(out)
    return kind


class OutputTarget:
    """A temporary sibling folder of ``out`` that becomes ``out`` (or yields ``out``'s file) on :meth:`commit`.

    Use as a context manager: leaving it without ``commit`` (an exception) deletes the temporary folder.
    """

    def __init__(self, out: Path, kind: str) -> None:
        self.out, self.kind = Path(out), kind
        parent = self.out.absolute().parent
        # the parent folders this creates, removed again on failure (deepest first)
        self._made = [p for p in [parent, *parent.parents] if not p.exists()]
        parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", suffix=".tmp", dir=self.out.parent))
        self.committed = False

    def __enter__(self) -> OutputTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.committed:
            shutil.rmtree(self.tmp, ignore_errors=True)
            for p in self._made:
                try:
                    p.rmdir()
                except OSError:  # no longer empty: something else writes there
                    break

    def commit(self) -> None:
        """Move the result into place (an existing ``out`` is replaced only as :func:`check_out` allowed)."""
        if self.kind == "file":
            os.replace(self.tmp / self.out.name, self.out)
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            if self.out.exists():
                shutil.rmtree(self.out)  # empty, or --overwrite
            os.chmod(self.tmp, 0o755)  # mkdtemp makes 0700; a model folder is meant to be shared
            os.replace(self.tmp, self.out)
        self.committed = True


def copy_model_files(dst: Path, model_folder: Path | None, tokenizer_folder: Path | None,
                     out_dtype: torch.dtype | None) -> list[str]:
    """Copy config / generation config from ``model_folder`` (recording ``out_dtype``) and the tokenizer files
    from ``tokenizer_folder``; returns the names copied."""
    copied = []
    if model_folder is not None and (model_folder / "config.json").is_file():
        config = json.loads((model_folder / "config.json").read_text())
        if out_dtype is not None:
            config.pop("torch_dtype", None)  # transformers >= 4.56 reads "dtype" (older: torch_dtype)
            config["dtype"] = str(out_dtype).removeprefix("torch.")
        (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copied.append("config.json")
    if model_folder is not None and (model_folder / "generation_config.json").is_file():
        shutil.copyfile(model_folder / "generation_config.json", dst / "generation_config.json")
        copied.append("generation_config.json")
    for name in TOKENIZER_FILES if tokenizer_folder is not None else []:
        if (tokenizer_folder / name).is_file() and not (dst / name).exists():
            shutil.copyfile(tokenizer_folder / name, dst / name)
            copied.append(name)
    return copied


class InputHashes:
    """sha256 of every input weight file, computed in a background thread while the merge runs.

    Args:
        files: the input weight files.
        enabled: ``False`` records no hashes (``--no-hash-inputs``: hashing reads every input once more,
            about 2 s of CPU per GB).
    """

    def __init__(self, files: Iterable[Path], enabled: bool = True) -> None:
        self.files = list(dict.fromkeys(Path(f) for f in files)) if enabled else []
        self.result: dict[str, str] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for f in self.files:
            blob = f.resolve().name if f.is_symlink() else ""
            if len(blob) == 64 and all(c in "0123456789abcdef" for c in blob):
                self.result[str(f)] = blob  # a hub cache blob is named by its sha256 (LFS files)
                continue
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                while block := fh.read(1 << 22):
                    h.update(block)
            self.result[str(f)] = h.hexdigest()

    def get(self) -> dict[str, str]:
        self._thread.join()
        return self.result


def write_model_card(dst: Path, *, recipe_yaml: str, inputs: list[tuple[str, str, list[str]]],
                     hashes: dict[str, str], base_model: str | None) -> None:
    """``README.md``: what was merged, how (the recipe), every input file's sha256 and the clmerge version.

    Args:
        inputs: ``(role, name, files)`` per input (role: ``base`` or ``model``).
    """
    from .. import __version__

    front = ["---", "library_name: transformers", "tags:", "- merge", "- clmerge"]
    front += [f"base_model: {base_model}"] if base_model else []
    lines = front + ["---", "", "# Merged model", "",
                     f"Made with clmerge {__version__} (`clmerge merge`) from the recipe below "
                     "(also in `clmerge_recipe.yaml`).", "", "```yaml", recipe_yaml.rstrip(), "```", "",
                     "## Inputs", "", "| role | input | file | sha256 |", "|---|---|---|---|"]
    for role, name, files in inputs:
        for f in sorted(files, key=lambda f: Path(f).name):
            digest = f"`{hashes[str(f)]}`" if str(f) in hashes else "not computed (--no-hash-inputs)"
            lines.append(f"| {role} | {name} | {Path(f).name} | {digest} |")
    (dst / "README.md").write_text("\n".join(lines) + "\n")
