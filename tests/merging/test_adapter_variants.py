"""Adapter merges for every PEFT variant: the adapter table of docs/adapters.md (every PEFT LoRA variant x
merge method, checked against peft's own ``merge_and_unload``) (tests/merging/test_adapter_variants.py generates it and checks the committed copy).

For each variant two adapters are made with peft on a tiny model holding every layer kind peft adapts
(``Linear`` with and without bias, ``Embedding``, ``Conv1d/2d/3d``), with random non-zero factors, and saved
with ``save_pretrained``. The oracle ``Delta W_t`` of an adapter is what ``PeftModel.from_pretrained(base,
adapter).merge_and_unload()`` changes in the base's state dict. A cell is ``exact`` when

1. clmerge's ``AdapterSource`` gives that ``Delta W_t`` for every changed tensor, and nothing else;
2. the ``full`` form (the merge over the whole model with the adapters as experts) equals the method run on
   plain dicts ``theta_0`` and ``theta_0 + Delta W_t`` (the oracle's), over all keys;
3. the adapter it writes (``peft`` form at full rank, or ``factored``), loaded by peft and merged with
   ``merge_and_unload``, changes the base by the method run on the oracle's updates over the changed keys;

all within float rounding; else it is ``refused`` with clmerge's one-line message (and nothing written).

The rules transcribed in clmerge (peft 0.21.2, ``site-packages/peft``): DoRA's merge ``W' = m / ||W + dW|| *
(W + dW)``, ``tuners/lora/variants.py`` lines 170-194 (Linear), 277-300 (Embedding), 382-404 (ConvNd), its
norm ``tuners/lora/dora.py`` lines 86-91 and 206-213; a convolution's ``get_delta_weight``,
``tuners/lora/layer.py`` lines 1755-1793; ``lora_bias`` merged as ``bias + s * lora_B.bias``, ``layer.py``
lines 990-1015; ``rank_pattern`` / ``alpha_pattern`` matching, ``utils/other.py`` lines 1524-1532. The oracle
makes the table independent of that reading: it is peft's own merge.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("peft")

TABLE_START, TABLE_END = "<!-- adapter-table:start -->", "<!-- adapter-table:end -->"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "adapters.md"


class Tiny(nn.Module):
    """Every layer kind peft's LoRA adapts, tiny."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.c1 = nn.Conv1d(8, 6, 3)
        self.c2 = nn.Conv2d(3, 5, 3)
        self.c3 = nn.Conv3d(2, 4, 2)
        self.gc = nn.Conv2d(4, 4, 3, groups=2)
        self.lin = nn.Linear(8, 6)
        self.nobias = nn.Linear(8, 6, bias=False)
        self.head = nn.Linear(6, 4)

    def forward(self, x):  # peft needs a module; the table never runs it
        return self.head(self.lin(self.emb(x)))


def tiny() -> Tiny:
    torch.manual_seed(0)
    return Tiny().eval()


LIN = ["lin", "head"]
ALL = ["lin", "head", "emb", "c1", "c2", "c3"]
# variant -> (config of adapter a, config of adapter b): peft.LoraConfig keyword arguments
VARIANTS: dict[str, tuple[dict, dict]] = {
    "LoRA on Linear": (dict(target_modules=LIN), dict(r=2, lora_alpha=3, target_modules=LIN)),
    "rsLoRA (`use_rslora`)": (dict(target_modules=LIN, use_rslora=True),
                              dict(r=2, target_modules=LIN, use_rslora=True)),
    "`rank_pattern` / `alpha_pattern`": (dict(target_modules=ALL, rank_pattern={"lin": 2, "c2": 3},
                                              alpha_pattern={"head": 3, "emb": 5}),
                                         dict(r=2, target_modules=LIN, alpha_pattern={"lin": 7})),
    "DoRA (`use_dora`) on Linear, Embedding, Conv1d/2d/3d": (dict(target_modules=ALL, use_dora=True),
                                                           dict(r=2, target_modules=ALL, use_dora=True)),
    "`lora_bias` (Linear, Conv2d)": (dict(target_modules=["lin", "c2"], lora_bias=True),
                                     dict(r=2, target_modules=["lin", "head"], lora_bias=True)),
    "Conv1d": (dict(target_modules=["c1"]), dict(r=2, target_modules=["c1"])),
    "Conv2d": (dict(target_modules=["c2"]), dict(r=2, target_modules=["c2"])),
    "Conv3d": (dict(target_modules=["c3"]), dict(r=2, target_modules=["c3"])),
    "Embedding (`lora_embedding_A/B`)": (dict(target_modules=["emb"]), dict(r=2, target_modules=["emb"])),
    "`modules_to_save`": (dict(target_modules=["lin"], modules_to_save=["head"]),
                          dict(r=2, target_modules=["lin", "head"])),
    "trained biases (`bias: lora_only`)": (dict(target_modules=LIN, bias="lora_only"),
                                           dict(r=2, target_modules=["lin"])),
    "different `target_modules`": (dict(target_modules=["lin", "c2"]), dict(r=2, target_modules=["head", "emb"])),
    "DoRA and plain LoRA on one module": (dict(target_modules=LIN, use_dora=True), dict(r=2, target_modules=LIN)),
    "`lora_bias` on a layer without bias": (dict(target_modules=["nobias"], lora_bias=True),
                                            dict(target_modules=["nobias"])),
    "grouped Conv2d (`groups=2`)": (dict(target_modules=["gc"]), dict(target_modules=["gc"])),
    "PiSSA / OLoRA / CorDA / LoftQ init, saved unconverted": (dict(target_modules=LIN, init_lora_weights="pissa"),
                                                             dict(target_modules=LIN)),
    "trainable tokens (`trainable_token_indices`)": (dict(target_modules=LIN, trainable_token_indices={"emb": [1, 2]}),
                                                    dict(target_modules=LIN)),
}
FAST_VARIANTS = ["rsLoRA (`use_rslora`)", "DoRA (`use_dora`) on Linear, Embedding, Conv1d/2d/3d",
                 "`lora_bias` (Linear, Conv2d)", "Conv3d", "`modules_to_save`", "PiSSA / OLoRA / CorDA / LoftQ init, "
                 "saved unconverted"]
# column -> (method, hyperparameters, form)
METHODS: dict[str, tuple[str, dict, str]] = {
    "weight_average": ("weight_average", {}, "peft"),
    "task_arithmetic −0.5 (negative)": ("task_arithmetic", {"scaling": -0.5}, "peft"),
    "weight_average [1, −0.5]": ("weight_average", {"weights": [1.0, -0.5]}, "peft"),
    "ties density 1": ("ties", {"density": 1.0}, "peft"),
    "ties density 0.5": ("ties", {"density": 0.5}, "peft"),
    "ties density 0": ("ties", {"density": 0.0}, "peft"),
    "dare density 1 (drop 0)": ("dare", {"drop_rate": 0.0, "scaling": 1.0}, "peft"),
    "dare density 0 (drop 1)": ("dare", {"drop_rate": 1.0, "scaling": 1.0}, "peft"),
    "factored task_arithmetic": ("task_arithmetic", {"scaling": 0.7}, "factored"),
}


def make_adapter(path: Path, seed: int, **kw) -> None:
    """A peft adapter on :func:`tiny` with random non-zero trainable tensors, saved with ``save_pretrained``."""
    import warnings

    import peft

    kw = dict(r=4, lora_alpha=8) | kw
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(tiny(), peft.LoraConfig(**kw))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in model.named_parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=g) * 0.3)
        model.save_pretrained(path)


def oracle(path: Path) -> dict[str, torch.Tensor]:
    """``{key: W' - W}`` of what peft's ``merge_and_unload`` changes (float32, non-zero changes only)."""
    import warnings

    import peft

    base = tiny().state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = peft.PeftModel.from_pretrained(tiny(), path).merge_and_unload().state_dict()
    assert set(merged) == set(base), set(merged) ^ set(base)
    return {k: (merged[k] - base[k]).detach() for k in base if not torch.equal(merged[k], base[k])}


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    scale = float(want.abs().max()) if want.numel() else 0.0
    return got.shape == want.shape and torch.allclose(got.double(), want.double(), rtol=1e-5,
                                                      atol=1e-6 * max(scale, 1e-3))


def _reference(method: str, hp: dict, base: dict, deltas: list[dict], keys: list[str]) -> dict:
    from clmerge import merging

    b = {k: base[k].double() for k in keys}
    experts = [{k: b[k] + d[k].double() if k in d else b[k].clone() for k in keys} for d in deltas]
    merged = merging.merge(method, base=b, experts=experts, **hp)
    return {k: merged[k] - b[k] for k in keys}


def cell(variant_dir: Path, base_dir: Path, column: str, oracles: list[dict]) -> str:
    """``exact`` or ``refused: <message>`` for the two adapters in ``variant_dir`` (a and b) and ``column``."""
    import peft

    from clmerge import merging
    from clmerge.merging.io import open_checkpoint
    from clmerge.merging.io.peft import AdapterSource
    from clmerge.merging.lora_merge import merge_adapters

    method, hp, form = METHODS[column]
    paths = [variant_dir / "a", variant_dir / "b"]
    base = open_checkpoint(base_dir)
    out = variant_dir / re.sub(r"\W+", "_", column)
    try:
        srcs = [AdapterSource(p, base) for p in paths]
        full = merging.merge(method, base=base, experts=srcs, **hp)
        merge_adapters(method=method, base=base, adapters=paths, hyperparameters=hp, out=out, form=form, rank=64)
    except (merging.MergeInputError, ValueError, TypeError) as exc:
        assert not out.exists(), out
        return "refused: " + _clean(str(exc), variant_dir)
    if oracles is None:
        return "NOT EXACT: clmerge merged adapters that peft cannot merge"
    base_sd = tiny().state_dict()
    for src, want in zip(srcs, oracles):  # 1. each adapter's Delta W
        if src.delta_keys != set(want) or not all(_close(src.delta(k), want[k]) for k in want):
            return f"NOT EXACT: Delta W of {src.name}"
    ref = _reference(method, hp, base_sd, oracles, sorted(base_sd))  # 2. the full form
    if not all(_close(full[k].double() - base_sd[k].double(), ref[k]) for k in base_sd):
        return "NOT EXACT: full form"
    keys = sorted(set().union(*oracles))  # 3. the written adapter, merged by peft
    ref = _reference(method, hp, base_sd, oracles, keys)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = peft.PeftModel.from_pretrained(tiny(), out).merge_and_unload().state_dict()
    for k in base_sd:
        want = ref.get(k, torch.zeros_like(base_sd[k], dtype=torch.float64))
        if not _close(got[k] - base_sd[k], want):
            return f"NOT EXACT: written adapter at {k}"
    return "exact"


def _clean(message: str, variant_dir: Path) -> str:
    """The message's first line with the temporary folders replaced by ``ADAPTER``."""
    first = message.strip().splitlines()[0]
    return re.sub(re.escape(str(variant_dir)) + r"/[ab]", "ADAPTER", first).replace(str(variant_dir), "DIR")


def build_rows(root: Path, variants: list[str]) -> dict[str, dict[str, str]]:
    """``{variant: {column: outcome}}``, the adapters and outputs made under ``root``."""
    from safetensors.torch import save_file

    base_dir = root / "base"
    base_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tiny().state_dict().items()}, str(base_dir / "model.safetensors"))
    rows = {}
    for i, name in enumerate(variants):
        vdir = root / f"v{i}"
        cfg_a, cfg_b = VARIANTS[name]
        make_adapter(vdir / "a", 100 + i, **cfg_a)
        make_adapter(vdir / "b", 200 + i, **cfg_b)
        try:
            oracles = [oracle(vdir / "a"), oracle(vdir / "b")]
        except Exception:  # peft cannot merge it itself: clmerge must refuse
            oracles = None
        rows[name] = {col: cell(vdir, base_dir, col, oracles) for col in METHODS}
    return rows


def render(rows: dict[str, dict[str, str]]) -> str:
    """The markdown table (cells ``exact`` or ``refused (n)``) and the numbered refusal messages."""
    messages: list[str] = []
    cols = list(METHODS)
    lines = ["| variant | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, cells in rows.items():
        out = []
        for col in cols:
            c = cells[col]
            if c.startswith("refused: "):
                msg = c[len("refused: "):]
                if msg not in messages:
                    messages.append(msg)
                c = f"refused ({messages.index(msg) + 1})"
            out.append(c)
        lines.append(f"| {name} | " + " | ".join(out) + " |")
    lines += ["", "Refusals (clmerge's one-line message; `ADAPTER` is the adapter folder):", ""]
    lines += [f"{i}. `{m}`" for i, m in enumerate(messages, 1)]
    return "\n".join(lines)


def committed_table() -> str:
    text = DOCS.read_text()
    return text[text.index(TABLE_START) + len(TABLE_START):text.index(TABLE_END)].strip()


def write_table(table: str) -> None:
    text = DOCS.read_text()
    head, tail = text[:text.index(TABLE_START) + len(TABLE_START)], text[text.index(TABLE_END):]
    DOCS.write_text(f"{head}\n{table}\n{tail}")


def _committed_rows() -> dict[str, dict[str, str]]:
    """The committed table parsed back into ``{variant: {column: exact | refused: message}}``."""
    table = committed_table()
    messages = dict(re.findall(r"^(\d+)\. `(.*)`$", table, flags=re.M))
    rows = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("| "):
            break
        name, *cells = [c.strip() for c in line.strip("|").split(" | ")]
        rows[name] = {col: re.sub(r"refused \((\d+)\)", lambda m: "refused: " + messages[m[1]], c)
                      for col, c in zip(METHODS, cells)}
    return rows


def _check_outcomes(rows: dict[str, dict[str, str]]) -> None:
    bad = {(v, c): o for v, cells in rows.items() for c, o in cells.items()
           if o != "exact" and not o.startswith("refused: ")}
    assert not bad, bad


@pytest.mark.slow
def test_committed_adapter_table_is_what_peft_gives(tmp_path):
    """Every variant x method is exact against merge_and_unload or refused in one line, and docs/adapters.md
    holds exactly this table (CLMERGE_WRITE_ADAPTER_TABLE=1 rewrites it there)."""
    rows = build_rows(tmp_path, list(VARIANTS))
    _check_outcomes(rows)
    table = render(rows)
    if os.environ.get("CLMERGE_WRITE_ADAPTER_TABLE") == "1":
        write_table(table)
    assert committed_table() == table


@pytest.mark.parametrize("variant", FAST_VARIANTS)
def test_adapter_table_rows_fast_subset(tmp_path, variant):
    """A fast subset of the table: these rows, generated again, are exact or refused and as committed."""
    rows = build_rows(tmp_path, [variant])
    _check_outcomes(rows)
    assert rows[variant] == _committed_rows()[variant]


def test_the_committed_table_covers_every_variant_and_method():
    rows = _committed_rows()
    assert list(rows) == list(VARIANTS)
    _check_outcomes(rows)
    assert sum(o == "exact" for cells in rows.values() for o in cells.values()) >= 85


# -- the write-back at a rank that loses more than 10 % --

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)


def _llama_adapters(root: Path) -> tuple[Path, list[Path]]:
    import warnings

    import peft
    import transformers

    torch.manual_seed(0)
    transformers.LlamaModel(transformers.LlamaConfig(**LLAMA)).save_pretrained(root / "base")
    paths = []
    for seed in (1, 2):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(transformers.LlamaModel(transformers.LlamaConfig(**LLAMA)),
                                        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        model.save_pretrained(root / f"a{seed}")
        paths.append(root / f"a{seed}")
    return root / "base", paths


def test_lossy_write_back_warns_with_the_rank_that_keeps_99_percent(tmp_path):
    """A TIES merge of two rank-4 adapters written back at rank 4 loses far more than 10 % (the merged update
    has full rank): one warning line names the loss and the rank whose error is at most 1 % in every module;
    the report and the card record it; that rank does keep 99 %."""
    from clmerge.merging.lora_merge import merge_adapters

    base, paths = _llama_adapters(tmp_path)
    res = merge_adapters(method="ties", base=base, adapters=paths, hyperparameters={"density": 0.5},
                         out=tmp_path / "m4", form="peft", rank=4)
    loss = res["rank_loss"]
    assert loss["max_rel_error"] == res["max_rel_error"] > 0.10 and loss["rank"] == 4
    assert f"{loss['max_rel_error']:.0%}" == "54%" and loss["suggested_rank"] == 29  # docs/adapters.md's example
    (line,) = [w for w in res["warnings"] if w.startswith("warning: rank 4 loses")]
    assert "\n" not in line and f"--adapter-rank {loss['suggested_rank']}" in line
    card = (tmp_path / "m4" / "README.md").read_text()
    assert f"rank 4 loses {loss['max_rel_error']:.0%}" in card and f"rank {loss['suggested_rank']} keeps 99%" in card
    again = merge_adapters(method="ties", base=base, adapters=paths, hyperparameters={"density": 0.5},
                           out=tmp_path / "mk", form="peft", rank=loss["suggested_rank"])
    assert again["max_rel_error"] <= 0.01 and "rank_loss" not in again
    assert not any("loses" in w for w in again["warnings"])
    below = merge_adapters(method="ties", base=base, adapters=paths, hyperparameters={"density": 0.5},
                           out=tmp_path / "mk1", form="peft", rank=loss["suggested_rank"] - 1)
    assert below["max_rel_error"] > 0.01  # the smallest such rank


def test_lossless_write_back_does_not_warn(tmp_path):
    from clmerge.merging.lora_merge import merge_adapters

    base, paths = _llama_adapters(tmp_path)
    res = merge_adapters(method="task_arithmetic", base=base, adapters=paths, hyperparameters={"scaling": 1.0},
                         out=tmp_path / "m", form="peft", rank=8)  # rank 4 + 4: exact
    assert res["max_rel_error"] < 1e-9 and "rank_loss" not in res and not res["warnings"]
    assert "loses" not in (tmp_path / "m" / "README.md").read_text()


def test_rank_for_error_is_the_smallest_rank_within_the_target():
    from clmerge.merging.io.lora_svd import rank_for_error

    s = torch.tensor([10.0, 1.0, 0.1, 0.01])
    total = float((s ** 2).sum())
    for k in range(1, 5):
        err = float((s[k:] ** 2).sum() / total) ** 0.5
        assert rank_for_error(s, err + 1e-12) == k
    assert rank_for_error(torch.zeros(3)) == 0


def test_randomized_svd_modules_get_their_spectrum_only_when_the_warning_needs_it():
    from clmerge.merging.io.lora_svd import low_rank_factors, rank_loss

    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 200, generator=g, dtype=torch.float64)
    low = low_rank_factors(x, 16, "randomized")
    assert low.spectrum is None and low.svd == "randomized"
    loss = rank_loss(16, {"m": low}, {"m": x})
    assert loss["suggested_rank"] > 16 and loss["worst_module"] == "m"


def test_cli_prints_the_lossy_write_back_warning_once(tmp_path):
    from checkpoint_helpers import invoke

    base, (p1, p2) = _llama_adapters(tmp_path)
    res = invoke("--method", "ties", "--base", base, "--expert", p1, "--expert", p2, "--adapter-out", "peft",
                 "--adapter-rank", "4", "--out", tmp_path / "m")
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.stderr.splitlines() if "loses" in ln]
    assert len(lines) == 1 and lines[0].startswith("warning: rank 4 loses") and "keeps 99%" in lines[0], res.stderr


@pytest.mark.parametrize("kw", [dict(use_dora=True), dict(lora_bias=True), dict(use_rslora=True)])
def test_fan_in_fan_out_variants_equal_merge_and_unload(tmp_path, kw):
    """GPT-2's ``Conv1D`` stores ``(in, out)``: DoRA's norm is then taken over the first dimension, and a
    ``lora_B`` bias is added as is; each Delta W is what merge_and_unload changes."""
    import warnings

    import peft
    import transformers

    from clmerge.merging.io import open_checkpoint
    from clmerge.merging.io.peft import AdapterSource

    cfg = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    transformers.GPT2Model(cfg).save_pretrained(tmp_path / "base")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = peft.get_peft_model(transformers.GPT2Model(cfg), peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True, **kw))
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for _, p in model.named_parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=g) * 0.3)
        model.save_pretrained(tmp_path / "a")
        torch.manual_seed(0)
        base = transformers.GPT2Model(cfg).state_dict()
        torch.manual_seed(0)
        merged = peft.PeftModel.from_pretrained(transformers.GPT2Model(cfg), tmp_path / "a").merge_and_unload()
    want = {k: v - base[k] for k, v in merged.state_dict().items() if not torch.equal(v, base[k])}
    src = AdapterSource(tmp_path / "a", open_checkpoint(tmp_path / "base"))
    assert src.delta_keys == set(want)
    for k, d in want.items():
        assert _close(src.delta(k), d), k
