"""Merging PEFT LoRA adapters on their dense updates, written back as a PEFT adapter.

Every registered merge method runs on ``theta_t = theta_0 + Delta W_t`` restricted to the adapted keys (in
float64, so that ``merged - theta_0`` recovers the merged update to float64 rounding), never on ``A`` and
``B`` separately: averaging the factors gives ``mean(B) mean(A)``, which is not ``mean(B A)``.

Output forms (``form``):

- ``"peft"``: the merged ``Delta W = merged - theta_0`` of each module re-factorised by truncated SVD at
  ``rank`` (default: the largest input rank), scale 1; the relative Frobenius error is reported;
- ``"factored"``: exact, for methods linear in the ``Delta W``'s (weight averaging, task arithmetic):
  ``B' = [c_1 s_1 B_1 | c_2 s_2 B_2 | ...]``, ``A' = [A_1; A_2; ...]``, rank ``sum_t r_t``;
- ``"full"`` (folded into the base) is the ordinary streaming merge with :class:`AdapterSource` experts.

Density-based methods (TIES, DARE, ...) count entries over the adapted keys only here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import UsageError
from ..utils.device import Device, parse_device, using_device
from .io.base import MergeInputError, ParamSource
from ..utils.io import write_json
from .io.checks import check_output_finite, source_get, source_meta
from .io.lora_svd import check_svd, clamped_note, device_low_rank_factors, error_summary
from .io.output import OutputFolder
from .io.peft import AdapterSource, LoraModule, adapter_config, write_adapter
from .methods.hparams import check_hyperparameters
from .methods.registry import MergeMethod, get_method

__all__ = ["ADAPTER_FOLDER_ONLY", "LINEAR_METHODS", "OpenedAdapters", "REPORT_FILE", "merge_adapters", "open_adapters",
           "write_merged_adapter"]

REPORT_FILE = "merge_report.json"
#: why ``--out X.safetensors`` is refused for an adapter merge
ADAPTER_FOLDER_ONLY = ("--adapter-out writes a PEFT adapter folder (adapter_config.json beside the weights), not one "
                       ".safetensors file")


def _weight_average_coeffs(n: int, hp: dict) -> list[float]:
    w = hp.get("weights")
    if w is None:
        return [1.0 / n] * n
    if len(w) != n:
        raise ValueError(f"weights: got {len(w)} values for {n} adapters")
    total = sum(float(x) for x in w)
    return [float(x) / total for x in w]


def _task_arithmetic_coeffs(n: int, hp: dict) -> list[float]:
    scaling = hp.get("scaling", get_method("task_arithmetic").hyperparameters()["scaling"])
    return [float(scaling)] * n


# Methods whose merged update is sum_t c_t Delta W_t: name -> (n adapters, hyperparameters) -> [c_t].
LINEAR_METHODS = {"weight_average": _weight_average_coeffs, "task_arithmetic": _task_arithmetic_coeffs}


class _KeyView(ParamSource):
    """``base`` or ``base + Delta W`` on the adapted keys only, float64 (a source ``ModelSet`` accepts)."""

    def __init__(self, base: Any, keys: list[str], adapter: AdapterSource | None, name: str) -> None:  # noqa: D107
        self.base, self._keys, self.adapter, self.name = base, keys, adapter, name

    def keys(self) -> list[str]:
        return list(self._keys)

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        return tuple(source_meta(self.base, key)[0]), torch.float64

    def get(self, key: str) -> Tensor:
        w = source_get(self.base, key).to(torch.float64, copy=True)  # a copy: the sum below must not touch the base
        if self.adapter is not None and key in self.adapter.delta_keys:
            w += self.adapter.delta(key, torch.float64)  # B A formed in float64, not float32 then widened
        return w


def _open(base: Any, adapters: Sequence[Any]) -> list[AdapterSource]:
    if not adapters:
        raise MergeInputError("merge_adapters: need at least one adapter")
    srcs = [a if isinstance(a, AdapterSource) else AdapterSource(a, base) for a in adapters]
    flips = {any(m.transpose for m in s.modules.values() if not m.embedding) for s in srcs}
    if len(flips) > 1:
        raise MergeInputError("adapters disagree on fan_in_fan_out; they must be trained on the same model")
    return srcs


def _modules(srcs: list[AdapterSource]) -> dict[str, LoraModule]:
    """``{base key: LoraModule}`` over all adapters (the first adapter that targets a key names it)."""
    found: dict[str, LoraModule] = {}
    for s in srcs:
        for key, m in s.modules.items():
            found.setdefault(key, m)
    return dict(sorted(found.items()))


def _refactorise(base, srcs, modules, method: MergeMethod, hp, rank, svd) -> tuple[dict, dict, int]:
    keys = list(modules)
    # the method resolved and its hyperparameter names checked when the adapters were opened (open_adapters)
    merged = method.fn(base=_KeyView(base, keys, None, base.name),
                       experts=[_KeyView(base, keys, s, s.name) for s in srcs], **hp)
    check_output_finite(method.name, merged)
    rank = rank or max(m.rank for s in srcs for m in s.modules.values())
    factors, errors = {}, {}
    for key, m in modules.items():
        delta = merged.pop(key).to(torch.float64) - source_get(base, key).to(torch.float64)
        low = device_low_rank_factors(delta.t() if m.transpose else delta, rank, svd)  # in LoRA layout (B A)
        factors[m.name], errors[m.name] = (low.a, low.b), low
    return factors, errors, rank


def _factored(srcs, modules, method: MergeMethod, hp) -> tuple[dict, dict]:
    if method.name not in LINEAR_METHODS:
        raise MergeInputError(f"form 'factored' is exact only for methods linear in the updates "
                              f"({', '.join(LINEAR_METHODS)}); use --adapter-out peft (SVD) or full for "
                              f"{method.name!r}")
    coeffs = LINEAR_METHODS[method.name](len(srcs), hp)
    factors = {}
    for key, first in modules.items():
        parts = [(c, s.modules[key]) for c, s in zip(coeffs, srcs) if key in s.modules]
        a = torch.cat([m.lora_a.float() for _, m in parts], dim=0)
        b = torch.cat([(c * m.scale) * m.lora_b.float() for c, m in parts], dim=1)
        factors[first.name] = (a, b)
    return factors, {m.name: (0.0, 1.0) for m in modules.values()}


def merge_adapters(*, method: str, base: Any, adapters: Sequence[Any], hyperparameters: dict | None = None,
                   out: str | Path, form: str = "peft", rank: int | None = None, svd: str = "auto",
                   overwrite: bool = False, device: str | Device | None = None) -> dict:
    """Merge PEFT LoRA adapters with any registered method and write the result as a PEFT adapter folder.

    Args:
        method: a registered merge method (``clmerge.merging.available()``).
        base: the model the adapters were trained on (a lazy source, or a path for ``open_checkpoint``).
        adapters: adapter folders (or :class:`AdapterSource` objects over ``base``).
        hyperparameters: the method's keyword hyperparameters.
        out: the new adapter folder (must not exist, or be empty); written atomically.
        form: ``"peft"`` (truncated SVD at ``rank``) or ``"factored"`` (exact, linear methods only).
        rank: the output rank for ``"peft"`` (default: the largest input rank).
        svd: ``"auto"``, ``"full"`` or ``"randomized"`` (:func:`.lora_svd.low_rank_factors`).
        overwrite: replace an existing non-empty ``out`` (``--overwrite``).
        device: ``cpu`` (default), ``cuda`` or ``cuda:N``: where the merge and the re-factorising SVDs
            compute (:mod:`clmerge.utils.device`); an active one adds ``"device"`` (wall time, peak memory)
            to the report.

    Returns:
        ``{"out", "form", "method", "keys", "rank", "max_rel_error", "overall_rel_error",
        "per_module_rel_error", "warnings", ...}`` (``warnings``: an adapter whose config names another
        base model; modules whose ``min(out, in)`` is below ``rank``, written at that rank), also written to
        ``out/merge_report.json``.

    Raises:
        MergeInputError: unreadable / unsupported adapters, keys that match no base key, or
            ``form="factored"`` with a non-linear method.
        OutputError: an unsafe ``out``.
    """
    if isinstance(base, (str, Path)):
        from .io.readers import open_checkpoint

        base = open_checkpoint(base)
    opened = open_adapters(method=get_method(method), base=base, adapters=adapters, hyperparameters=hyperparameters,
                           form=form, rank=rank, svd=svd)
    # the one output check, as `clmerge merge --adapter-out` makes it (clmerge.merging.run)
    output = OutputFolder(Path(out), [opened.base, *opened.srcs], overwrite=overwrite, hash_inputs=False,
                          folder_only=ADAPTER_FOLDER_ONLY)
    return write_merged_adapter(opened, output, device=device)


@dataclass
class OpenedAdapters:
    """Adapters checked and opened over their base, ready to merge (:func:`open_adapters`)."""

    method: MergeMethod
    base: Any
    srcs: list[AdapterSource]
    hp: dict
    form: str
    rank: int | None
    svd: str


def open_adapters(*, method: MergeMethod, base: Any, adapters: Sequence[Any], hyperparameters: dict | None = None,
                  form: str = "peft", rank: int | None = None, svd: str = "auto") -> OpenedAdapters:
    """Check the form, rank, SVD and the method's hyperparameter names, and open the adapters over the opened
    ``base``; nothing is written (the arguments as in :func:`merge_adapters`; ``method`` resolved by the caller)."""
    if form not in ("peft", "factored"):
        raise MergeInputError(f"form {form!r}: merge_adapters writes 'peft' or 'factored' ('full' is the "
                              "ordinary merge with AdapterSource experts)")
    if rank is not None and rank < 1:
        raise UsageError(f"--adapter-rank must be >= 1, got {rank}")
    check_svd(svd)
    hp = dict(hyperparameters or {})
    # unknown names fail before any work, in either form
    check_hyperparameters(method, hp, types=False, data_ok=True, error=TypeError)
    srcs = _open(base, adapters)
    return OpenedAdapters(method, base, srcs, hp, form, rank, svd)


def write_merged_adapter(opened: OpenedAdapters, output: OutputFolder, *, device: str | Device | None = None) -> dict:
    """Merge the opened adapters and write them as one PEFT adapter folder through ``output`` (checked when it
    was made; built aside and moved into place only when complete); returns the report (:func:`merge_adapters`)."""
    out = output.out
    method, base, srcs, hp, form, rank, svd = (opened.method, opened.base, opened.srcs, opened.hp, opened.form,
                                               opened.rank, opened.svd)
    modules = _modules(srcs)
    dev = parse_device(device)
    dev.start()
    if form == "peft":
        with using_device(dev):
            factors, errors, out_rank = _refactorise(base, srcs, modules, method, hp, rank, svd)
    else:
        factors, errors = _factored(srcs, modules, method, hp)
        out_rank = max(a.shape[0] for a, _ in factors.values())
    ranks = {mod: a.shape[0] for mod, (a, _) in factors.items()}
    pattern = {mod: r for mod, r in ranks.items() if r != out_rank}
    cfg0 = srcs[0].config
    transpose = any(m.transpose for m in modules.values() if not m.embedding)
    config = adapter_config(r=out_rank, alpha=out_rank, targets=list(factors), fan_in_fan_out=transpose,
                            rank_pattern=pattern, alpha_pattern=pattern,
                            base_model=cfg0.get("base_model_name_or_path"), task_type=cfg0.get("task_type"))
    report = {"out": str(out), "form": form, "method": method.name, "hyperparameters": hp,
              "adapters": [s.name for s in srcs], "keys": list(modules), "rank": out_rank,
              "ranks": ranks, **error_summary(errors),
              "warnings": [w for w in [*(s.warning for s in srcs), clamped_note(pattern, out_rank)] if w]}
    if form == "factored":
        report.update(max_rel_error=0.0, overall_rel_error=0.0, per_module_rel_error={m: 0.0 for m in ranks})
    if dev.active:
        report["device"] = dev.stats()

    with output:
        write_adapter(output.tmp, factors, config, {m.name for m in modules.values() if m.embedding})
        write_json(output.tmp / REPORT_FILE, report)
        output.commit()
    return report
