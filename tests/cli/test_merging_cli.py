"""``clmerge merge``: happy path, input formats, and every error leaves nothing written."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from clmerge import merging
from clmerge.cli import app

from merging_helpers import make_models


@pytest.fixture()
def files(tmp_path):
    base, ex = make_models(3, seed=0)
    save_file(base, str(tmp_path / "base.safetensors"))
    paths = []
    for i, e in enumerate(ex):
        p = tmp_path / f"e{i}.safetensors"
        save_file(e, str(p))
        paths.append(p)
    return tmp_path, base, ex, paths


def invoke(*args):
    return CliRunner().invoke(app, ["merge", *map(str, args)])


def expert_args(paths):
    return [x for p in paths for x in ("--expert", p)]


def test_merge_writes_same_as_api(files):
    tmp, base, ex, paths = files
    out = tmp / "m.safetensors"
    r = invoke("--method", "ties", "--base", tmp / "base.safetensors", *expert_args(paths), "--out", out,
               "--set", "density=0.3", "--set", "scaling=0.9", "--set", "trim_scope=per_tensor")
    assert r.exit_code == 0, r.output
    want = merging.ties(base=base, experts=ex, density=0.3, scaling=0.9, trim_scope="per_tensor")
    got = load_file(str(out))
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_pt_and_bin_inputs(files):
    tmp, base, ex, paths = files
    pts = []
    for i, e in enumerate(ex):
        p = tmp / f"e{i}.{'pt' if i % 2 else 'bin'}"
        torch.save(e, p)
        pts.append(p)
    out = tmp / "avg.safetensors"
    r = invoke("--method", "weight_average", *expert_args(pts), "--out", out)
    assert r.exit_code == 0, r.output
    want = merging.weight_average(experts=ex)
    assert torch.equal(load_file(str(out))["blk.fc1.weight"], want["blk.fc1.weight"])


def _bad(tmp, name, mutate, ex):
    e = {k: v.clone() for k, v in ex[1].items()}
    mutate(e)
    p = tmp / name
    save_file(e, str(p))
    return p


@pytest.mark.parametrize("mutate, words", [
    # the base decides the key set, so the error names the base beside the bad input
    (lambda e: e.pop("blk.fc2.weight"), ["blk.fc2.weight", "missing", "bad.safetensors", "base.safetensors"]),
    (lambda e: e.__setitem__("norm.weight", torch.zeros(5)), ["norm.weight", "shape", "bad.safetensors"]),
    # mixed floating dtypes are upcast; a non-floating dtype mismatch is still an error
    (lambda e: e.__setitem__("buf.index", e["buf.index"].int()), ["buf.index", "dtype"]),
    (lambda e: e["blk.fc1.bias"].__setitem__(0, float("nan")), ["blk.fc1.bias", "NaN", "bad.safetensors"]),
    (lambda e: e["blk.fc1.bias"].__setitem__(1, float("inf")), ["blk.fc1.bias", "Inf"]),
])
def test_bad_inputs_are_errors_and_write_nothing(files, mutate, words):
    tmp, base, ex, paths = files
    bad = _bad(tmp, "bad.safetensors", mutate, ex)
    out = tmp / "never.safetensors"
    r = invoke("--method", "task_arithmetic", "--base", tmp / "base.safetensors", "--expert", paths[0],
               "--expert", bad, "--out", out)
    assert r.exit_code == 3  # InputError (docs/cli_errors.md)
    for w in words:
        assert w in r.output, (w, r.output)
    assert not out.exists()
    assert not list(tmp.glob(".never*"))


def test_usage_errors(files):
    tmp, base, ex, paths = files
    out = tmp / "x.safetensors"
    cases = [
        (["--method", "nope", *expert_args(paths)], "unknown merge method"),
        (["--method", "ties", *expert_args(paths)], "needs --base"),
        (["--method", "ties", "--base", tmp / "base.safetensors", *expert_args(paths), "--set", "densty=1"],
         "not a hyperparameter"),
        (["--method", "fisher_merging", *expert_args(paths)], "Python API"),
        (["--method", "weight_average", "--expert", tmp / "missing.safetensors"], "no such weights file"),
    ]
    for args, msg in cases:
        r = invoke(*args, "--out", out)
        code = 3 if "no such" in msg else 2  # a missing input is an InputError (docs/cli_errors.md)
        assert r.exit_code == code and msg in r.output, (args, r.output)
    assert not out.exists()


def test_merge_error_during_compute_writes_nothing(files):
    tmp, base, ex, paths = files
    out = tmp / "y.safetensors"
    out.write_bytes(b"old")
    r = invoke("--method", "ties", "--base", tmp / "base.safetensors", *expert_args(paths), "--out", out,
               "--set", "density=2", "--overwrite")  # without --overwrite an existing file is refused
    assert r.exit_code == 2 and "density" in r.output
    assert out.read_bytes() == b"old"


def test_set_values_read_the_same_yaml_grammar_as_run_set():
    # `[a,b]`, `yes` and `1e-3` mean in `clmerge merge --set` what they mean in `clmerge run --set`
    from clmerge.merging.run import parse_set
    from clmerge.utils.yaml_io import parse_assignment

    items = ["scaling=[0.6,1.0]", "normalize=yes", "density=1e-3", "trim_scope=global", "x=[a,b]"]
    assert parse_set(items) == dict(parse_assignment(i) for i in items)
    assert parse_set(items) == {"scaling": [0.6, 1.0], "normalize": True, "density": 1e-3,
                                "trim_scope": "global", "x": ["a", "b"]}


def test_a_set_without_equals_is_a_usage_error():
    from clmerge.errors import UsageError
    from clmerge.merging.run import parse_set

    with pytest.raises(UsageError, match="--set 'density': expected key=value"):
        parse_set(["density"])


def test_a_merge_method_from_a_plugin_file_is_usable_from_merge(files, tmp_path):
    # one function plus one registration (docs/extending.md), loaded by `clmerge merge --plugin FILE`
    d, base, ex, paths = files
    plugin = tmp_path / "half_tv_plugin.py"
    plugin.write_text(
        "from clmerge.merging.methods.driver import map_keys\n"
        "from clmerge.merging.methods.registry import register_merge\n"
        "from clmerge.merging.methods.sources import open_models\n\n\n"
        "@register_merge('half_tv_test_plugin', 'base + scaling * the mean task vector')\n"
        "def half_tv(*, base, experts, scaling: float = 1.0):\n"
        "    models = open_models(base, experts)\n"
        "    return map_keys(models, lambda k, b, xs: b.float() + scaling * sum(x.float() - b.float() for x in xs)"
        " / len(xs), needs_base=True)\n")
    out = tmp_path / "plug.safetensors"
    r = invoke("--plugin", plugin, "--method", "half_tv_test_plugin", "--base", d / "base.safetensors",
               *expert_args(paths), "--set", "scaling=0.5", "--out", out)
    assert r.exit_code == 0, r.output
    got = load_file(str(out))
    for k, b in base.items():
        want = b.float() + 0.5 * sum(e[k].float() - b.float() for e in ex) / len(ex)
        assert torch.allclose(got[k].float(), want, atol=1e-6)
