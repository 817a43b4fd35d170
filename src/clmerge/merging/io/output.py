"""The output of a merge: a complete model folder (or one safetensors file), built aside and renamed at the end.

:func:`check_out` refuses an unsafe ``--out`` before any work with the one output guard
(:func:`clmerge.utils.outpaths.check_output_dir`): one that names an input or lies inside one, an existing
non-empty folder or an existing file (unless ``overwrite``), another weight format's suffix (``.pt``, ``.bin``,
...; any other name but ``X.safetensors`` is a folder, ``merged-v1.5`` included).
:class:`OutputTarget` builds everything in a temporary sibling folder and renames it into place only when the
merge succeeded, never over an output another process wrote meanwhile; on any failure (SIGTERM included) the
temporary folder is removed, so nothing is left. :func:`model_files` lists the config and tokenizer files to
copy, each checked to lie inside its folder and to be a regular file; every input file is read through
:mod:`clmerge.utils.inpaths`.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import InputError, OutputError
from ...utils import inpaths
from ...utils.inpaths import InputMissing, inside, read_bytes
from ...utils.io import write_json
from ...utils.outpaths import check_output_dir
from ...utils.procs import pid_alive
from ...utils.provenance import provenance
from ...utils.progress import phase
from .base import NO_CAP, MergeInputError
from .writer import BackgroundWriter, ShardedWriter

__all__ = ["TOKENIZER_FILES", "FolderJob", "InputHashes", "OutputFolder", "OutputTarget", "build_folder", "check_out", "copy_model_files",
           "model_files", "recipe_header", "remove_stale_temps", "write_model_card"]

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.txt", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "preprocessor_config.json", "processor_config.json", "spiece.model"]


#: The files copied from the model folder (the others come from the tokenizer folder), and their size kind.
_CONFIG_FILES = ("config.json", "generation_config.json")


def _input_paths(sources: Iterable[Any]) -> list[Path]:
    """The files and folders the opened ``sources`` read (what an output must never replace or hold)."""
    paths = []
    for s in sources:
        folder = getattr(s, "folder", None)
        paths += [Path(folder)] if folder is not None else []
        paths += [Path(f) for f in getattr(s, "files", [])]
    return [p.resolve() for p in paths]


def check_out(out: Path, sources: Iterable[Any], *, overwrite: bool = False) -> str:
    """Refuse an unsafe ``out`` before any work; returns ``"file"`` (``X.safetensors``) or ``"folder"``.

    The rule is :func:`clmerge.utils.outpaths.check_output_dir`'s (a merge's output is never inside an input,
    ``X.safetensors`` is a file, another weight format's suffix is refused); this only names the sources' paths.

    Raises:
        OutputError: one line naming ``out`` and what is wrong with it (exit code 5).
    """
    inputs = _input_paths(sources)
    return check_output_dir(Path(out), flag="--out", inputs=inputs, overwrite=overwrite, file_suffix=".safetensors",
                            inside_inputs=False)


class OutputTarget:
    """A temporary sibling folder of ``out`` that becomes ``out`` (or yields ``out``'s file) on :meth:`commit`.

    Use as a context manager: leaving it without ``commit`` (an exception, Ctrl-C, or SIGTERM, which is turned
    into ``SystemExit(143)`` while the target is open) deletes the temporary folder. The folder is named
    ``.OUT.<pid>.<random>.tmp``; a later run removes such folders whose process is gone (a ``kill -9``).

    ``out`` is replaced only if it already held something when the target was made (:func:`check_out` allowed
    that with ``--overwrite``). If it appears meanwhile (a second merge into the same new ``--out``), the
    final move refuses and leaves the other result as it is.

    Args:
        log: receives one line per stale temporary folder removed.
    """

    def __init__(self, out: Path, kind: str, log: Callable[[str], None] = lambda s: None) -> None:
        self.out, self.kind = Path(out), kind
        parent = self.out.absolute().parent
        # the parent folders this creates, removed again on failure (deepest first)
        self._made = [p for p in [parent, *parent.parents] if not p.exists()]
        parent.mkdir(parents=True, exist_ok=True)
        for stale in remove_stale_temps(self.out):
            log(f"removed {stale}: the temporary folder of an earlier clmerge process that no longer runs")
        self._replace = self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir()))
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.{os.getpid()}.", suffix=".tmp",
                                         dir=self.out.parent))
        self.committed = False
        self._old_term = None

    def __enter__(self) -> OutputTarget:
        if threading.current_thread() is threading.main_thread():
            self._old_term = signal.signal(signal.SIGTERM, _terminated)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
        if not self.committed:
            shutil.rmtree(self.tmp, ignore_errors=True)
            for p in self._made:
                try:
                    p.rmdir()
                except OSError:  # no longer empty: something else writes there
                    break
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OutputError(f"--out {self.out}: {exc.strerror or 'no space left'} while writing "
                              f"{exc.filename or self.tmp} (nothing was left behind)") from None

    def commit(self) -> None:
        """Move the result into place; refuses (exit 5) if ``out`` appeared meanwhile and was not to be replaced."""
        src = self.tmp / self.out.name if self.kind == "file" else self.tmp
        if self.kind == "folder":
            os.chmod(self.tmp, 0o755)  # mkdtemp makes 0700; a model folder is meant to be shared
        if self._replace:
            _replace_existing(src, self.out)
        else:
            _move_no_clobber(src, self.out)
        if self.kind == "file":
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.committed = True


def build_folder(out: Path, fill: Callable[[Path], dict], report_name: str | None = None) -> dict:
    """Build a folder with ``fill(tmp_dir) -> report`` in an :class:`OutputTarget`, verify it (an adapter
    folder: :func:`_verify_built`) and move it to ``out`` (``report``, with the verification, is also written as
    ``report_name`` there when given). An existing non-empty ``out`` is
    replaced only if it was there when this began (``--overwrite`` let it through the checks)."""
    with OutputTarget(Path(out), "folder") as target:
        report = fill(target.tmp)
        report = _verify_built(target.tmp, Path(out), report)
        if report_name:
            write_json(target.tmp / report_name, report)
        target.commit()
    return report


def _verify_built(tmp: Path, out: Path, report: Any) -> Any:
    """:func:`build_folder`'s verification (:mod:`.verify`) of an adapter folder (``extract-lora``, ``export
    --format peft``): recorded in ``report`` (a dict); a failure raises :class:`~.verify.VerificationError`
    before the folder is moved into place. (``export --format hf`` writes a continual run's backbone, not a
    merge: not verified here.)"""
    from .verify import VerificationError, verify_folder

    if not (tmp / "adapter_config.json").exists():
        return report
    v = verify_folder(tmp, name=str(out))
    if not v.ok:
        raise VerificationError(v)
    return {**report, "verification": v.to_dict()} if isinstance(report, dict) else report


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C, so the temporary folder is removed


_TEMP_NAME = r"\.{name}\.(\d+)\.[A-Za-z0-9_]{{8}}\.(?:tmp|old)"


def remove_stale_temps(out: Path) -> list[Path]:
    """Remove the temporary folders of ``out`` (``.OUT.<pid>.*.tmp``) whose process no longer runs."""
    pattern = re.compile(_TEMP_NAME.format(name=re.escape(out.name)))
    removed = []
    for p in out.absolute().parent.glob(f".{glob.escape(out.name)}.*"):
        m = pattern.fullmatch(p.name)
        if m and p.is_dir() and not p.is_symlink() and not pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _appeared(out: Path) -> OutputError:
    return OutputError(f"--out {out}: appeared while this merge ran (another process wrote it); it was left as "
                       "it is and this result discarded: choose another --out, or pass --overwrite")


def _move_no_clobber(src: Path, out: Path) -> None:
    """Rename ``src`` to ``out`` unless ``out`` holds something (a rename fails on a non-empty folder)."""
    if src.is_dir():
        try:
            os.rename(src, out)  # replaces an empty folder atomically, fails on a non-empty one or a file
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise _appeared(out) from None
            raise
        return
    try:
        os.link(src, out)  # fails if out exists: no window between the check and the move
    except FileExistsError:
        raise _appeared(out) from None
    except OSError:  # a file system without hard links
        if out.exists():
            raise _appeared(out) from None
        os.replace(src, out)


def _replace_existing(src: Path, out: Path) -> None:
    """``--overwrite``: move the old ``out`` aside, move ``src`` in, then delete the old one."""
    if not src.is_dir() or not out.exists():
        os.replace(src, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", suffix=".old", dir=out.absolute().parent))
    os.replace(out, old / out.name)
    os.rename(src, out)
    shutil.rmtree(old, ignore_errors=True)


def file_kind(name: str) -> str:
    """The size-cap kind (:data:`clmerge.utils.inpaths.LIMITS`) of a model folder's file ``name``."""
    return "json" if name in _CONFIG_FILES else "tokenizer"


def model_files(model_folder: Path | None, tokenizer_folder: Path | None) -> dict[str, Path]:
    """``{name: source}`` of the config, generation config and tokenizer files a merge copies, each checked
    before anything is read or merged: it resolves inside its folder (a symlink to ``/etc/passwd`` is refused:
    :func:`clmerge.utils.inpaths.inside`), and it opens as a regular file under its size cap (a FIFO, a device,
    a socket, a folder or a symlink loop of that name is refused by name, never skipped:
    :func:`clmerge.utils.inpaths.open_input`)."""
    wanted = [(model_folder, name) for name in _CONFIG_FILES]
    wanted += [(tokenizer_folder, name) for name in TOKENIZER_FILES]
    found = {}
    for folder, name in wanted:
        if folder is None or name in found or not os.path.lexists(Path(folder) / name):
            continue
        what = f"{folder}: model file"
        path = inside(folder, name, what)
        with inpaths.open_input(path, within=folder, what=what, kind=file_kind(name)):
            pass  # opened and checked; nothing read
        found[name] = path
    return found


def copy_model_files(dst: Path, model_folder: Path | None, tokenizer_folder: Path | None,
                     out_dtype: torch.dtype | None, edit_config: Callable[[dict], dict] | None = None,
                     config_updates: dict[str, Any] | None = None) -> list[str]:
    """Copy config / generation config from ``model_folder`` (recording ``out_dtype``, and ``config_updates``
    where the config has those keys; ``edit_config`` rewrites both files) and the tokenizer files from
    ``tokenizer_folder`` (:func:`model_files`), each read through the input boundary; a file already in ``dst``
    is kept. Returns the names copied."""
    copied = []
    for name, src in model_files(model_folder, tokenizer_folder).items():
        within = model_folder if name in _CONFIG_FILES else tokenizer_folder
        what = f"{within}: model file"
        if name == "config.json" or (name in _CONFIG_FILES and edit_config is not None):
            config = inpaths.read_json(src, within=within, what=what)
            if name == "config.json" and out_dtype is not None and isinstance(config, dict):
                config.pop("torch_dtype", None)  # transformers >= 4.56 reads "dtype" (older: torch_dtype)
                config["dtype"] = str(out_dtype).removeprefix("torch.")
            if name == "config.json" and config_updates and isinstance(config, dict):
                config.update({k: v for k, v in config_updates.items() if k in config})
            if edit_config is not None and isinstance(config, dict):
                config = edit_config(config)
            (dst / name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        elif not (dst / name).exists():
            (dst / name).write_bytes(read_bytes(src, within=within, what=what, kind=file_kind(name)))
        else:
            continue
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
        self._error: MergeInputError | None = None
        self._where = Path.cwd()  # relative inputs are read from here, whatever the process does meanwhile
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for f in self.files:
            try:
                self._hash(f)
            except InputMissing:  # reported by get(), not as a stray thread traceback and a silent gap
                self._error = MergeInputError(f"{f}: cannot read this input to record its sha256 (no such file)")
            except InputError as exc:  # replaced by something that is not a regular file
                self._error = MergeInputError(f"{f}: cannot read this input to record its sha256 ({exc})")
            except OSError as exc:
                self._error = MergeInputError(f"{exc.filename or f}: cannot read this input to record its sha256 "
                                              f"({exc.strerror or type(exc).__name__})")
            if self._error is not None:
                return

    def _hash(self, f: Path) -> None:
        path = self._where / f
        blob = path.resolve().name if path.is_symlink() else ""
        if len(blob) == 64 and all(c in "0123456789abcdef" for c in blob):
            self.result[str(f)] = blob  # a hub cache blob is named by its sha256 (LFS files)
            return
        h = hashlib.sha256()
        with inpaths.open_input(path, max_bytes=NO_CAP) as fh:
            while block := fh.read(1 << 22):
                h.update(block)
        self.result[str(f)] = h.hexdigest()

    def get(self) -> dict[str, str]:
        """``{file as given: sha256}`` once every input is hashed.

        Raises:
            MergeInputError: an input could not be read (it vanished or became unreadable during the merge).
        """
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.result


def recipe_header() -> str:
    """The comment lines that open a recorded recipe: the clmerge version and commit that made the output, and
    each plugin imported (its path and sha256, and the ``--plugin`` that re-running the recipe needs)."""
    info = provenance()
    lines = [f"# made by clmerge {info['clmerge_version']} (commit {info['clmerge_commit']}); every "
             "hyperparameter as the merge used it (defaults filled in)"]
    lines += [f"# plugin {p['plugin']}: {p['path']} sha256 {p['sha256']} (re-run with --plugin {p['path']})"
              for p in info["plugins"]]
    return "\n".join(lines) + "\n"


def write_model_card(dst: Path, *, recipe_yaml: str, inputs: list[tuple[str, str, list[str]]],
                     hashes: dict[str, str], base_model: str | None, recipe_file: str = "clmerge_recipe.yaml") -> None:
    """``README.md``: what was merged, how (the recipe, every hyperparameter as used), every input file's
    sha256, the clmerge version and commit, and the plugins imported (path and sha256).

    Args:
        inputs: ``(role, name, files)`` per input (role: ``base`` or ``model``).
    """
    info = provenance()
    front = ["---", "library_name: transformers", "tags:", "- merge", "- clmerge"]
    front += [f"base_model: {base_model}"] if base_model else []
    lines = front + ["---", "", "# Merged model", "",
                     f"Made by `clmerge merge` (clmerge {info['clmerge_version']}, commit {info['clmerge_commit']}) "
                     f"from the recipe below (also in `{recipe_file}`), every hyperparameter as the merge used it "
                     "(defaults filled in).", "", "```yaml", recipe_yaml.rstrip(), "```", ""]
    if info["plugins"]:
        lines += ["## Plugins", "", "Imported with `--plugin`; re-running the recipe needs the same code.", "",
                  "| plugin | path | sha256 |", "|---|---|---|"]
        lines += [f"| {p['plugin']} | {p['path']} | `{p['sha256']}` |" for p in info["plugins"]]
        lines.append("")
    lines += ["## Inputs", "", "| role | input | file | sha256 |", "|---|---|---|---|"]
    for role, name, files in inputs:
        for f in sorted(files, key=lambda f: Path(f).name):
            digest = f"`{hashes[str(f)]}`" if str(f) in hashes else "not computed (--no-hash-inputs)"
            lines.append(f"| {role} | {name} | {Path(f).name} | {digest} |")
    (dst / "README.md").write_text("\n".join(lines) + "\n")


class KeyCounter:
    """A writer that counts the distinct keys written into a progress phase (a merge key by key); everything
    else is the wrapped writer's."""

    def __init__(self, writer: Any, bar: Any) -> None:
        self._writer, self._bar, self._seen = writer, bar, set()

    def write(self, key: str, tensor: torch.Tensor) -> None:
        self._writer.write(key, tensor)
        if key not in self._seen:  # a rewrite (TIES's sign fix) is not another key
            self._seen.add(key)
            self._bar.update()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


@dataclass
class FolderJob:
    """One model folder that :meth:`OutputFolder.write` builds: the tensors (``plan``: ``(key, shape, dtype)``
    in write order), ``fill(writer)`` that writes each one (``writer.write(key, tensor)``), and the files beside
    them (``files``: the keyword arguments of :meth:`OutputFolder.write_files`).

    Args:
        subfolder: ``""`` for the output itself, else a folder inside it (``task_3`` of a per-task merge).
        background: write the shards in a background thread (overlapping the merge of the next key).
        done: a line logged when this folder is written.
    """

    plan: list
    fill: Callable[[Any], None]
    shard_size: int
    metadata: dict[str, str]
    files: dict[str, Any]
    subfolder: str = ""
    background: bool = False
    done: str | None = None


class OutputFolder:
    """The one writer of a model folder (``clmerge merge``, its slice and stage recipes, ``clmerge moe``).

    Made before any work, it checks ``out`` against the inputs (:func:`check_out`: ``"folder"``, or ``"file"``
    for ``X.safetensors`` unless ``folder_only`` names why a folder is needed) and the config and tokenizer
    files it will copy (:func:`model_files`). As a context manager it hashes the inputs in the background and
    builds into a temporary sibling folder (:class:`OutputTarget`); :meth:`write_shards` streams the tensors
    into it, :meth:`write_files` copies the model files and writes the recipe and the model card, and
    :meth:`commit` moves the result into place (nothing is left behind otherwise).
    """

    def __init__(self, out: Path, inputs: Iterable[Any], *, overwrite: bool = False, folder_only: str | None = None,
                 hash_inputs: bool = True, log: Callable[[str], None] = lambda s: None,
                 reshapes: bool = False) -> None:
        self.out, self.inputs, self.log = Path(out), [s for s in inputs if s is not None], log
        # the output's architecture differs from its inputs' (an MoE, a layer stack): verifying it imports
        # transformers, so that import starts in the background at once (:func:`_warm_verifier`)
        self.reshapes = reshapes
        self.kind = check_out(self.out, self.inputs, overwrite=overwrite)
        if folder_only and self.kind != "folder":
            raise OutputError(f"--out {out}: {folder_only}")
        self.overwrite, self.hash_inputs = overwrite, hash_inputs
        self.hashes: InputHashes | None = None
        self.target: OutputTarget | None = None
        # verification before the move into place (:meth:`commit`, :mod:`.verify`): per folder written, what it
        # is checked against; folders whose tensors the sharded writer checked finite
        self.to_verify: dict[Path, dict[str, Any]] = {}
        self._sharded: set[Path] = set()
        self.verification: list[Any] = []

    def check_files(self, model_folder: Path | None, tokenizer_folder: Path | None) -> None:
        """Refuse a config or tokenizer file that leads out of its folder, before any work (folders only)."""
        if self.kind == "folder":
            model_files(model_folder, tokenizer_folder)

    def __enter__(self) -> OutputFolder:
        files = [f for s in self.inputs for f in getattr(s, "files", [])]
        self.hashes = InputHashes(files, enabled=self.hash_inputs) if self.kind == "folder" else None
        self.target = OutputTarget(self.out, self.kind, log=self.log).__enter__()
        if self.kind == "folder":
            _warm_verifier(self.inputs, always=self.reshapes)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.target.__exit__(*exc)

    @property
    def tmp(self) -> Path:
        return self.target.tmp

    def write_shards(self, folder: Path, plan: list, fill: Callable[[Any], None], *, shard_size: int,
                     metadata: dict[str, str], background: bool = False) -> None:
        """Stream ``plan``'s tensors into ``folder``: ``fill(writer)`` writes each one (``writer.write``)."""
        writer = ShardedWriter(folder, plan, shard_size=shard_size, metadata=metadata,
                               single_file=self.out.name if self.kind == "file" else None)
        writer = BackgroundWriter(writer) if background else writer
        try:
            with phase(desc=f"merge {self.out.name}: tensors", total=len(plan)) as bar:
                fill(KeyCounter(writer, bar))
            writer.close()
        except BaseException:
            writer.abort()
            raise
        self._sharded.add(Path(folder))  # close() checked every tensor finite

    def write_files(self, folder: Path, *, model_folder: Path | None, tokenizer_folder: Path | None,
                    dtype: torch.dtype | None, recipe_file: str, recipe_yaml: str, base_model: str | None,
                    inputs: list[tuple[str, str, list[str]]], after_copy: Callable[[Path], None] | None = None,
                    tokenizer_files: dict[str, bytes] | None = None, edit_config: Callable[[dict], dict] | None = None,
                    report: dict | None = None, config_updates: dict[str, Any] | None = None,
                    template_folder: Path | None = None, tokenizer_reference: Path | None = None) -> None:
        """The files beside the shards (folders only): ``tokenizer_files`` (a tokenizer built for the merge:
        name -> bytes) or the tokenizer files copied from ``tokenizer_folder``, the config files of
        ``model_folder`` (the config recording ``dtype`` and ``config_updates`` where it has those keys;
        ``edit_config`` rewrites both config files;
        ``after_copy(folder)`` may rewrite them), ``merge_report.json`` (``report``), the recipe as
        ``recipe_file`` and ``README.md``. The folder is verified against ``model_folder`` (dtypes),
        ``tokenizer_reference`` (else ``tokenizer_folder``, else ``model_folder``: special tokens) and
        ``template_folder`` (a chat template taken from another input) before :meth:`commit` moves it into
        place."""
        if self.kind != "folder":
            return
        for name, data in (tokenizer_files or {}).items():
            (folder / name).write_bytes(data)
        copy_model_files(folder, model_folder, tokenizer_folder, dtype, edit_config, config_updates)
        if after_copy is not None:
            after_copy(folder)
        if report is not None:
            write_json(folder / "merge_report.json", report)
        recipe_yaml = recipe_header() + recipe_yaml  # the version, commit and plugins that made it
        (folder / recipe_file).write_text(recipe_yaml)
        write_model_card(folder, recipe_yaml=recipe_yaml, inputs=inputs, hashes=self.hashes.get(),
                         base_model=base_model, recipe_file=recipe_file)
        self.to_verify[Path(folder)] = {"against": model_folder, "reload": "auto",
                                        "tokenizer_reference": tokenizer_reference or tokenizer_folder or model_folder,
                                        "template_reference": template_folder}

    def write(self, jobs: list[FolderJob]) -> None:
        """Build every folder of ``jobs`` (shards, then the model files, recipe and model card) in the
        temporary folder, then move the result into place; on any failure nothing is left behind."""
        with self:
            for job in jobs:
                folder = self.tmp / job.subfolder if job.subfolder else self.tmp
                folder.mkdir(exist_ok=True)
                self.write_shards(folder, job.plan, job.fill, shard_size=job.shard_size, metadata=job.metadata,
                                  background=job.background)
                self.write_files(folder, **job.files)
                if job.done:
                    self.log(job.done)
            self.commit()

    def commit(self) -> None:
        """Verify every folder written (:meth:`verify`), then move the result into place.

        Raises:
            VerificationError: a folder failed (exit code 3); nothing is moved into place and the temporary
                folder is removed on leaving the context.
        """
        self.verify()
        self.target.commit()

    def verify(self) -> None:
        """Verify each folder :meth:`write_files` wrote (a model folder) or, with none, the output folder itself
        (an adapter folder) with :func:`.verify.verify_folder`; the result goes into its ``README.md`` (a
        ``## Verification`` section) and ``merge_report.json`` (``"verification"``) when those exist, and into
        :attr:`verification`. A single ``.safetensors`` file has no config to verify against: only the
        writer's checks apply (every planned key written, every tensor finite)."""
        from .verify import VerificationError, card_section, verify_folder

        if self.kind != "folder":
            return
        failed = []
        # no model folder written (an adapter folder): checked against the base, the first input
        fallback = {self.tmp: {"against": self.inputs[0]} if self.inputs else {}}
        for folder, refs in (self.to_verify or fallback).items():
            rel = folder.relative_to(self.tmp)
            shown = str(self.out / rel) if str(rel) != "." else str(self.out)
            v = verify_folder(folder, finite_checked=folder in self._sharded, name=shown, **refs)
            self.verification.append(v)
            self.log(f"{shown}: {v.summary()}")
            for problem in v.problems:
                self.log(f"  problem: {problem}")
            card = folder / "README.md"
            if card.exists():  # our own file, written just now
                card.write_text(inpaths.read_text(card, within=folder) + "\n" + card_section(v))
            report = folder / "merge_report.json"
            if report.exists():
                data = inpaths.read_json(report, within=folder)
                if isinstance(data, dict):
                    write_json(report, {**data, "verification": v.to_dict()})
            failed += [v] if not v.ok else []
        if failed:
            raise VerificationError(failed[0] if len(failed) == 1 else _joined(failed))


def _joined(failed: list[Any]) -> Any:
    """One :class:`~.verify.Verification` holding the problems of several folders (a per-task merge)."""
    from .verify import Verification

    joined = Verification(", ".join(v.folder for v in failed))
    joined.problems = [f"{v.folder}: {p}" for v in failed for p in v.problems]
    return joined


def _warm_verifier(inputs: list[Any], *, always: bool = False) -> None:
    """Start importing transformers and the inputs' model class in the background (:func:`.verify.warm_up`), so
    the reload check at the end costs only the meta-device load. Not when every input folder has one
    architecture (:func:`.verify.same_architecture`): the output then has it too, and the check answers from
    the reference without transformers (``reload="auto"``); an output that differs after all imports at the end."""
    from .verify import same_architecture, warm_up

    found = []
    for src in inputs:
        folder = getattr(src, "folder", None)
        if folder is None or not (Path(folder) / "config.json").is_file():
            continue
        try:
            config = inpaths.read_json(Path(folder) / "config.json", within=Path(folder),
                                       what=f"{folder}: model file")
            tensors = {k: src.meta(k) for k in src.keys()}
        except (InputError, KeyError):
            continue
        if isinstance(config, dict):
            found.append((config, tensors))
    if not found or (not always and len(found) > 1 and same_architecture(found)):
        return
    warm_up(*found[0])
