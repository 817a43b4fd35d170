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

import json
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
from ..utils.provenance import provenance
from .io.checks import check_output_finite, source_get, source_meta
from .io.lora_svd import (KEEP_ERROR, LowRank, check_svd, clamped_note, device_low_rank_factors, error_summary,
                          rank_loss)
from .io.output import OutputFolder
from .io.peft import AdapterSource, LoraModule, adapter_config, write_adapter
from .methods.hparams import check_hyperparameters
from .methods.registry import MergeMethod, get_method

__all__ = ["ADAPTER_FOLDER_ONLY", "LINEAR_METHODS", "OpenedAdapters", "REPORT_FILE", "merge_adapters", "open_adapters",
           "write_merged_adapter"]

REPORT_FILE = "merge_report.json"
CARD_FILE = "README.md"
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
    scaling = float(hp.get("scaling", get_method("task_arithmetic").hyperparameters()["scaling"]))
    if hp.get("normalize") and abs(scaling * n) >= 1e-8:  # as the method: every weight is lambda
        scaling = 1.0 / n
    return [scaling] * n


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


@dataclass
class _Layout:
    """How the merged updates are written back (:func:`_layout`).

    Attributes:
        keys: every base key some adapter changes.
        lora: ``{base weight key: LoraModule}`` written as LoRA factors (the first adapter's module names it).
        biases: ``{base bias key: parameter name}`` written as ``lora_B`` biases (scale 1: the merged change).
        saved: ``{module name: {base key: parameter name}}`` written whole (``modules_to_save``).
    """

    keys: list[str]
    lora: dict[str, LoraModule]
    biases: dict[str, str]
    saved: dict[str, dict[str, str]]


def _layout(base: Any, srcs: list[AdapterSource]) -> _Layout:
    """LoRA factors where every adapter changes a weight by LoRA (or DoRA); ``lora_B`` biases for the biases of
    those modules when every LoRA module's base layer has a bias (peft cannot merge a ``lora_B`` bias into a
    layer without one); every other change (``modules_to_save``, saved biases or embeddings) as its module
    saved whole, so that it is exact."""
    names: dict[str, str] = {}
    lora: dict[str, LoraModule] = {}
    for s in srcs:
        for k, n in s.names.items():
            names.setdefault(k, n)
        for k, m in s.modules.items():
            lora.setdefault(k, m)

    def module(key: str) -> str:
        return names[key].rsplit(".", 1)[0]

    replaced = {module(k) for s in srcs for k in s.saved if not names[k].endswith(".bias")}
    lora = {k: m for k, m in lora.items() if m.name not in replaced}
    lora_modules = {m.name: k.rsplit(".", 1)[0] for k, m in lora.items()}
    biases = {k: n for k, n in names.items() if k not in lora and module(k) in lora_modules and n.endswith(".bias")}
    base_keys = set(base.keys())
    if biases and not all(f"{prefix}.bias" in base_keys for prefix in lora_modules.values()):
        lora = {k: m for k, m in lora.items() if module(k) not in {module(b) for b in biases}}
        biases = {}
    saved: dict[str, dict[str, str]] = {}
    for k in sorted(names):
        if k not in lora and k not in biases:
            prefix, mod = k.rsplit(".", 1)[0], module(k)
            saved[mod] = {b: f"{mod}.{b.rsplit('.', 1)[1]}" for b in sorted(base_keys) if b.rsplit(".", 1)[0] == prefix}
    return _Layout(sorted(names), dict(sorted(lora.items())), biases, saved)


def _lora_matrix(delta: Tensor, m: LoraModule) -> Tensor:
    """``Delta W`` as the ``(out, in)`` matrix that ``B A`` is (transposed back; a kernel flattened)."""
    return delta.t() if m.transpose else delta.reshape(delta.shape[0], -1)


def _lora_factors(low: LowRank, m: LoraModule) -> tuple[Tensor, Tensor]:
    """``(A, B)`` in the module's layout (a convolution's ``(k, in, *kernel)`` and ``(out, k, 1, ...)``)."""
    k, kernel = low.a.shape[0], m.lora_a.shape[2:]
    return low.a.reshape(k, *m.lora_a.shape[1:]), low.b.reshape(low.b.shape[0], k, *[1] * len(kernel))


def _default_rank(srcs: list[AdapterSource]) -> int:
    return max((m.rank for s in srcs for m in s.modules.values()), default=8)


def _refactorise(base, srcs, layout: _Layout, method: MergeMethod, hp, rank, svd):
    # the method resolved and its hyperparameter names checked when the adapters were opened (open_adapters)
    merged = method.fn(base=_KeyView(base, layout.keys, None, base.name),
                       experts=[_KeyView(base, layout.keys, s, s.name) for s in srcs], **hp)
    check_output_finite(method.name, merged)
    rank = rank or _default_rank(srcs)
    factors, errors, pending = {}, {}, {}
    extra = _saved_tensors(base, layout, merged)
    for key, m in layout.lora.items():
        delta = _lora_matrix(merged.pop(key).to(torch.float64) - source_get(base, key).to(torch.float64), m)
        low = device_low_rank_factors(delta, rank, svd)  # in LoRA layout (B A)
        factors[m.name], errors[m.name] = _lora_factors(low, m), low
        if low.spectrum is None and low.tail > KEEP_ERROR ** 2 * low.total:
            pending[m.name] = delta  # its singular values only if the write-back warning needs them
    for key, name in layout.biases.items():
        extra[name.replace(".bias", ".lora_B.bias")] = (merged.pop(key) - source_get(base, key).double()).float()
    return factors, errors, rank, extra, rank_loss(rank, errors, pending)


def _saved_tensors(base, layout: _Layout, merged: dict) -> dict[str, Tensor]:
    """The modules saved whole: their merged tensors (the base's where nothing changed), in the base's dtype."""
    out = {}
    for params in layout.saved.values():
        for key, name in params.items():
            dtype = source_meta(base, key)[1]
            out[name] = (merged.pop(key) if key in merged else source_get(base, key)).to(dtype)
    return out


def _factored(base, srcs, layout: _Layout, method: MergeMethod, hp) -> tuple[dict, dict, dict]:
    if method.name not in LINEAR_METHODS:
        raise MergeInputError(f"form 'factored' is exact only for methods linear in the updates "
                              f"({', '.join(LINEAR_METHODS)}); use --adapter-out peft (SVD) or full for "
                              f"{method.name!r}")
    dora = next((s.name for s in srcs if any(m.magnitude is not None for m in s.modules.values())), None)
    if dora:
        raise MergeInputError(f"{dora}: a DoRA adapter's Delta W is not s*B*A, so it has no exact factored form; "
                              "use --adapter-out peft (SVD) or full")
    coeffs = LINEAR_METHODS[method.name](len(srcs), hp)
    factors = {}
    for key, first in layout.lora.items():
        parts = [(c, s.modules[key]) for c, s in zip(coeffs, srcs) if key in s.modules]
        a = torch.cat([m.lora_a.float() for _, m in parts], dim=0)
        b = torch.cat([(c * m.scale) * m.lora_b.float() for c, m in parts], dim=1)
        factors[first.name] = (a, b)

    def combined(key: str) -> Tensor:  # sum_t c_t Delta_t, float64
        return sum((c * s.delta(key, torch.float64) for c, s in zip(coeffs, srcs) if key in s.delta_keys),
                   torch.zeros(source_meta(base, key)[0], dtype=torch.float64))

    merged = {k: source_get(base, k).double() + combined(k) for p in layout.saved.values() for k in p}
    extra = _saved_tensors(base, layout, merged)
    extra.update({n.replace(".bias", ".lora_B.bias"): combined(k).float() for k, n in layout.biases.items()})
    return factors, {m.name: (0.0, 1.0) for m in layout.lora.values()}, extra


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
    layout = _layout(base, srcs)
    dev = parse_device(device)
    dev.start()
    loss = None
    if form == "peft":
        with using_device(dev):
            factors, errors, out_rank, extra, loss = _refactorise(base, srcs, layout, method, hp, rank, svd)
    else:
        factors, errors, extra = _factored(base, srcs, layout, method, hp)
        out_rank = max((a.shape[0] for a, _ in factors.values()), default=rank or _default_rank(srcs))
    ranks = {mod: a.shape[0] for mod, (a, _) in factors.items()}
    pattern = {mod: r for mod, r in ranks.items() if r != out_rank}
    cfg0 = srcs[0].config
    transpose = any(m.transpose for m in layout.lora.values() if not m.embedding)
    config = adapter_config(r=out_rank, alpha=out_rank, targets=list(factors), fan_in_fan_out=transpose,
                            rank_pattern=pattern, alpha_pattern=pattern,
                            base_model=cfg0.get("base_model_name_or_path"), task_type=cfg0.get("task_type"),
                            lora_bias=bool(layout.biases), modules_to_save=list(layout.saved))
    report = {"out": str(out), "form": form, "method": method.name, "hyperparameters": hp, **provenance(),
              "adapters": [s.name for s in srcs], "keys": layout.keys, "rank": out_rank,
              "ranks": ranks, "lora_bias": sorted(layout.biases.values()), "modules_to_save": sorted(layout.saved),
              **error_summary(errors),
              "warnings": [w for w in [*(s.warning for s in srcs), clamped_note(pattern, out_rank),
                                       loss and loss["warning"]] if w]}
    if form == "factored":
        report.update(max_rel_error=0.0, overall_rel_error=0.0, per_module_rel_error={m: 0.0 for m in ranks})
    if loss:
        report["rank_loss"] = {k: v for k, v in loss.items() if k != "warning"}
    if dev.active:
        report["device"] = dev.stats()

    with output:
        write_adapter(output.tmp, factors, config, {m.name for m in layout.lora.values() if m.embedding}, extra)
        write_json(output.tmp / REPORT_FILE, report)
        (output.tmp / CARD_FILE).write_text(adapter_card(report))
        output.commit()
    return report


def adapter_card(report: dict) -> str:
    """``README.md`` of a merged adapter: what was merged, how, at which rank, and what the write-back lost."""
    lines = ["# Merged LoRA adapter", "", f"Written by clmerge: `{report['method']}` of {len(report['adapters'])} "
             f"adapters, hyperparameters `{json.dumps(report['hyperparameters'], sort_keys=True)}`, form "
             f"`{report['form']}`, rank {report['rank']}.", "", "Adapters:", "",
             *[f"- `{a}`" for a in report["adapters"]], "",
             f"Write-back error (relative Frobenius error of the merged Delta W): {report['max_rel_error']:.2%} in "
             f"the worst module, {report['overall_rel_error']:.2%} over all modules (`merge_report.json` has each "
             "module's)."]
    loss = report.get("rank_loss")
    if loss:
        lines += ["", f"**Loss:** rank {loss['rank']} loses {loss['max_rel_error']:.0%} in `{loss['worst_module']}`; "
                  f"rank {loss['suggested_rank']} keeps 99% (error at most 1% in every module)."]
    return "\n".join(lines) + "\n"
