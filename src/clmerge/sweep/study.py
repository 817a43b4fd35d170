"""Run a study (``clmerge study``): schedule expert and merge jobs on an executor, stream results to disk.

The driver owns the files; workers only compute. Every expert is cached under ``CACHE/<task>-<sha16>``
(safetensors + JSON) by the SHA-256 of the config that makes it, so points share experts and a rerun trains
nothing it already has. A merge job is submitted as soon as its experts exist, and each merged point is
appended to ``DIR/results.jsonl`` the moment it finishes. At the end the file is rewritten in the
study's point order, so the local and Ray backends leave the same file (up to the ``timings`` fields).

``resume=True`` keeps the finished lines and runs only the missing points.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ..errors import ClmergeError
from ..engine.checkpoint import ResumeError, verify_sha256
from ..engine.resume import config_differences, summarize_differences
from ..harness.merge_bench import BenchConfig, expert_digest, expert_path, parse_task
from ..harness.merge_bench_experts import cached_file_sha256
from ..theory.jobs import expert_job, merge_job, stability_configs
from ..theory.spec import HYPERPARAMETERS, Point, StudySpec, canonical_method, expand_points
from ..utils.inpaths import read_bytes, read_json, read_jsonl_lines
from ..utils.io import append_jsonl, atomic_write_text, save_tensors, write_json
from ..utils.outpaths import child
from ..utils.yaml_io import YamlError, load_yaml, read_yaml
from .executors import Executor, make_executor

__all__ = ["run_study", "read_results", "StudyError"]


class StudyError(ClmergeError, RuntimeError):
    """Some jobs failed; the finished points are on disk and ``--resume`` retries the rest (exit code 1)."""


def read_results(out: Path) -> list[dict[str, Any]]:
    """The records of ``out/results.jsonl`` (a torn last line, from a killed run, is skipped)."""
    path = Path(out) / "results.jsonl"
    if not os.path.lexists(path):
        return []
    rows = []
    for line in read_jsonl_lines(path, within=out):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        rows.append(row | {"method": canonical_method(row["method"])} if "method" in row else row)
    return rows


class _Experts:
    """The experts a set of points needs: cached ones loaded, missing ones submitted, all as handles."""

    def __init__(self, ex: Executor, cache: Path, threads: int) -> None:
        self.ex, self.cache, self.threads = ex, cache, threads
        self.handles: dict[str, Any] = {}  # digest -> handle (or stored value)
        self.ready: set[str] = set()
        self.pending: dict[Any, str] = {}  # handle -> digest
        self.infos: dict[str, dict] = {}
        self._what: dict[str, tuple[str, BenchConfig]] = {}

    def need(self, task: str, cfg: BenchConfig) -> str:
        digest = expert_digest(parse_task(task), cfg)
        if digest in self.handles:
            return digest
        self._what[digest] = (task, cfg)
        path = expert_path(self.cache, parse_task(task), cfg)
        meta = path.with_suffix(".json")
        if path.exists() and meta.exists():
            doc = read_json(meta, within=self.cache)
            info = doc.get("info") if isinstance(doc, dict) else None
            if info is not None:
                params = read_bytes(path, within=self.cache, what="cached expert", kind="data")
                verify_sha256(path, cached_file_sha256(path), what="cached expert", data=params,
                              hint="delete it and its .json to retrain")
                self.infos[digest] = info
                self.handles[digest] = self.ex.put({"params": params, "info": info})
                self.ready.add(digest)
                return digest
        h = self.ex.submit(expert_job, task, asdict(cfg), self.threads)
        self.handles[digest], self.pending[h] = h, digest
        return digest

    def finished(self, h: Any, res: dict) -> str:
        digest = self.pending.pop(h)
        task, cfg = self._what[digest]
        path = expert_path(self.cache, parse_task(task), cfg)
        path.parent.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import load

        file_sha = save_tensors(path, load(res["params"]), metadata={"sha256_of_config": digest})
        write_json(path.with_suffix(".json"), {"sha256": digest, "config": cfg.expert_key(parse_task(task)),
                                               "info": res["info"], "file_sha256": file_sha})
        self.infos[digest] = res["info"]
        self.ready.add(digest)
        return digest


def _needs(spec: StudySpec, p: Point, experts: _Experts) -> dict[str, Any]:
    """Digests of the point's experts, its stability originals and twins, and (weighting points) its
    reference experts."""
    out: dict[str, Any] = {"experts": [experts.need(t, c) for t, c in zip(p.tasks, [c for _, c in p.expert_configs(spec)])]}
    if spec.measure.stability and p.kind == "grid":
        draws = stability_configs(spec, p)
        out["originals"] = [experts.need(p.tasks[0], orig) for orig, _ in draws[1:]]
        out["twins"] = [experts.need(p.tasks[0], c) for _, twins in draws for c in twins]
    if p.kind == "weighting":
        ref = p.model_copy(update={"steps": spec.defaults.steps})
        out["refs"] = [experts.need(t, c) for t, (_, c) in zip(p.tasks, ref.expert_configs(spec))]
    return out


def _all_digests(needs: dict[str, Any]) -> list[str]:
    return needs["experts"] + needs.get("twins", []) + needs.get("originals", []) + needs.get("refs", [])


def _record(p: Point, res: dict, needs: dict, experts: _Experts) -> dict[str, Any]:
    infos = [experts.infos[d] for d in needs["experts"]]
    timings = res.pop("timings") | {"expert_train_s": [i["train_s"] for i in infos]}
    hp = {k: getattr(p, k) for k in HYPERPARAMETERS} | {"momentum": p.momentum}
    rec = {"point_id": p.id, "kind": p.kind, "varied": p.varied, **hp, "seed": p.seed, "group": p.group,
           "tasks": p.tasks, "method": p.method["name"],
           "method_options": {k: v for k, v in p.method.items() if k != "name"}, **res,
           "experts": [{k: i[k] for k in ("task", "n_train", "test_loss", "test_acc")} for i in infos]}
    return rec | {"timings": timings}


def _prepare(out: Path, spec: StudySpec, resume: bool) -> set[str]:
    saved = out / "study.yaml"
    if resume and not saved.is_file():  # a mistyped --out never starts a fresh study
        raise ResumeError(f"{out}: no study to resume (no study.yaml); check the --out path or drop --resume")
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    if results.exists() and not resume:
        raise FileExistsError(f"{results} exists: use --resume to continue that study, or another --out")
    text = yaml.safe_dump(spec.model_dump(), sort_keys=False)
    if resume:
        stored, given = _read_saved_spec(saved), load_yaml(text) or {}
        for m in stored.get("methods") if isinstance(stored.get("methods"), list) else []:
            if isinstance(m, dict) and isinstance(m.get("name"), str):  # a study written under an old name
                m["name"] = canonical_method(m["name"])
        diffs = config_differences(stored, given)
        if diffs and not _only_adds_seeds(stored, given):
            raise ResumeError(f"{saved} differs from the spec given: --resume needs the same study (it may "
                              f"only add seeds)\n{summarize_differences(diffs)}")
    atomic_write_text(child(out, saved.name), text)
    rows = read_results(out)
    # rewrite without a torn last line (a killed run), so appended records start on a fresh line
    atomic_write_text(child(out, results.name), "".join(json.dumps(r) + "\n" for r in rows))
    return {r["point_id"] for r in rows}


def _read_saved_spec(saved: Path) -> dict:
    """The ``study.yaml`` a study directory holds (a corrupt one refuses the resume, naming it)."""
    try:
        stored = read_yaml(saved, within=saved.parent) or {}
    except YamlError as exc:
        raise ResumeError(f"{exc}; cannot check the study to resume") from None
    if not isinstance(stored, dict):
        raise ResumeError(f"{saved}: not a study spec (its top level is not a mapping)")
    return stored


def _only_adds_seeds(stored: dict, given: dict) -> bool:
    """Whether ``given`` is ``stored`` with more seeds: every finished point keeps its id (``point_id`` holds the
    point's own seed, not the list), so ``--resume`` can grow a study seed by seed."""
    old, new = stored.get("seeds") or [], given.get("seeds") or []
    same_rest = {k: v for k, v in stored.items() if k != "seeds"} == {k: v for k, v in given.items() if k != "seeds"}
    return same_rest and set(old) <= set(new)


def run_study(spec: StudySpec, out: str | Path, *, backend: str = "local", workers: int = 0,
              address: str | None = None, num_cpus: int | None = None, resume: bool = False,
              cache: str | Path | None = None, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run every point of ``spec`` not yet in ``out/results.jsonl``; return all records in point order.

    Raises:
        FileExistsError: results exist and ``resume`` is false. StudyError: some jobs failed.
    """
    out = Path(out)
    done = _prepare(out, spec, resume)
    points = expand_points(spec)
    todo = [p for p in points if p.id not in done]
    log(f"{len(points)} points, {len(points) - len(todo)} already done, {len(todo)} to run ({backend})")
    ex = make_executor(backend, workers=workers, address=address, num_cpus=num_cpus)
    failures: list[str] = []
    try:
        _schedule(ex, spec, todo, out, Path(cache) if cache else out / "experts", failures, log)
    finally:
        ex.close()
    order = {p.id: i for i, p in enumerate(points)}
    rows = sorted((r for r in read_results(out) if r["point_id"] in order), key=lambda r: order[r["point_id"]])
    atomic_write_text(child(out, "results.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    if failures:
        raise StudyError(f"{len(failures)} job(s) failed (first: {failures[0]}); rerun with --resume")
    return rows


def _schedule(ex: Executor, spec: StudySpec, todo: list[Point], out: Path, cache: Path, failures: list[str],
              log: Callable[[str], None]) -> None:
    experts = _Experts(ex, cache, spec.threads)
    waiting = [(p, _needs(spec, p, experts)) for p in todo]
    merges: dict[Any, tuple[Point, dict]] = {}
    sdump, t0, n_done = spec.model_dump(), time.perf_counter(), 0

    def submit_ready() -> None:
        nonlocal waiting
        still = []
        for p, needs in waiting:
            if all(d in experts.ready for d in _all_digests(needs)):
                h = experts.handles
                args = [p.model_dump(), sdump, [h[d] for d in needs["experts"]],
                        [h[d] for d in needs["twins"]] if "twins" in needs else None,
                        [h[d] for d in needs["refs"]] if "refs" in needs else None,
                        [h[d] for d in needs["originals"]] if "originals" in needs else None]
                merges[ex.submit(merge_job, *args)] = (p, needs)
            else:
                still.append((p, needs))
        waiting = still

    submit_ready()
    while experts.pending or merges:
        h = ex.wait_any(list(merges) + list(experts.pending))  # merges first: results stream early
        try:
            res = ex.result(h)
        except Exception as exc:  # a failed job: report, keep going, --resume retries
            what = experts.pending.pop(h, None) or merges.pop(h)[0].id
            failures.append(f"{what}: {type(exc).__name__}: {exc}")
            log(f"FAILED {failures[-1]}")
            continue
        if h in experts.pending:
            experts.finished(h, res)
            submit_ready()
            continue
        p, needs = merges.pop(h)
        append_jsonl(child(out, "results.jsonl"), _record(p, res, needs, experts))
        n_done += 1
        log(f"[{n_done}/{len(todo)} {time.perf_counter() - t0:.0f}s] {p.method['name']} {p.varied or 'default'} "
            f"N={p.n_experts} seed={p.seed} g={p.group}: loss {res['merged_loss']:.4f} acc {res['merged_acc']:.1f}")
    for p, _ in waiting:  # experts failed
        failures.append(f"{p.id}: an expert it needs failed")
