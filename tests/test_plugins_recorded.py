"""Plugins are first class: a run records its plugin (path, sha256) in ``manifest.json``; ``export``, ``eval``,
``report`` and ``run --resume`` import it again through the one function that opens a run directory
(``clmerge.utils.provenance.open_run_plugins``), say so in one line, and refuse a changed or vanished file in
one line naming it (and both hashes). A merge made with ``--plugin`` records it in its card and recipe."""

from __future__ import annotations

import hashlib
import json
import shutil
import textwrap

import pytest
import torch
import yaml
from safetensors.torch import save_file
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.merging.methods.registry import MERGES
from clmerge.methods.base import METHODS
from clmerge.utils import provenance
from clmerge.utils.provenance import git_commit
from clmerge.version import VERSION
from conftest import tiny_config

METHOD = "plugin_recorded_head_only"
PLUGIN = textwrap.dedent(f'''
    """A tiny method: a frozen backbone, only the head trains."""
    from clmerge.methods.base import ContinualMethod, register_method


    @register_method
    class HeadOnly(ContinualMethod):
        name = "{METHOD}"
        description = "plugin test: train the head only"

        def setup(self, model):
            model.backbone.requires_grad_(False)
''')


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fresh() -> None:
    """This process as a new one would be: no plugin imported, the plugin's method unregistered."""
    provenance.forget_plugins()
    if METHOD in METHODS:
        METHODS.unregister(METHOD)


@pytest.fixture(autouse=True)
def isolated():
    """Plugins imported by other tests in this process stay out of these runs, and these stay out of theirs."""
    saved = provenance.forget_plugins()
    yield
    _fresh()
    provenance.restore_plugins(saved)


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture()
def run(tmp_path):
    """A finished 2-task run of the plugin's method (the tiny default config), made with --plugin."""
    plugin = tmp_path / "my_plugin.py"
    plugin.write_text(PLUGIN)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_config(**{"method": {"name": METHOD},
                                                                      "train.epochs": 1})))
    res = _cli("run", tmp_path / "tiny.yaml", "--plugin", plugin, "--out", tmp_path / "r")
    assert res.exit_code == 0, res.output
    return tmp_path / "r", plugin


def _loading(plugin) -> str:
    return f"loading plugin {plugin.resolve()} (sha256 {_sha(plugin)[:16]})"


def test_a_run_records_its_plugin_the_version_and_the_commit(run):
    run_dir, plugin = run
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["plugins"] == [{"plugin": str(plugin), "path": str(plugin.resolve()), "sha256": _sha(plugin)}]
    assert manifest["clmerge_version"] == VERSION and manifest["clmerge_commit"] == git_commit()
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["method"]["name"] == METHOD  # resolved config


def test_export_eval_report_and_resume_load_the_recorded_plugin_and_say_so(run, tmp_path):
    run_dir, plugin = run
    commands = {"export": ["export", run_dir, "--format", "hf", "--out", tmp_path / "exported"],
                "eval": ["eval", run_dir, "--data", "digits"],
                "report": ["report", run_dir],
                "resume": ["run", run_dir / "config.yaml", "--out", run_dir, "--resume"]}
    for name, args in commands.items():
        _fresh()  # a new process: nothing knows the method until the run's plugin is imported
        res = _cli(*args)
        assert res.exit_code == 0, (name, res.output)
        assert res.stderr.count(_loading(plugin)) == 1, (name, res.stderr)
        assert METHOD in METHODS
    assert (tmp_path / "exported" / "classes.json").is_file()
    # given again with --plugin (the same code): imported once, nothing more to say
    _fresh()
    res = _cli("export", run_dir, "--format", "hf", "--out", tmp_path / "again", "--plugin", plugin)
    assert res.exit_code == 0 and "loading plugin" not in res.stderr, res.output


def _rerecorded(run_dir, tmp_path, path, sha):
    """A copy of the run whose manifest records the plugin at ``path`` with ``sha``."""
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["plugins"] = [{"plugin": str(path), "path": str(path), "sha256": sha}]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.mark.parametrize("command", ["export", "eval", "report", "resume"])
def test_a_changed_plugin_is_refused_naming_the_file_and_both_hashes(run, tmp_path, command):
    run_dir, plugin = run
    edited = tmp_path / "edited_plugin.py"
    edited.write_text(PLUGIN + "# edited after the run\n")
    copy = _rerecorded(run_dir, tmp_path, edited, _sha(plugin))
    _fresh()
    args = {"export": ["export", copy, "--format", "hf", "--out", tmp_path / "x"],
            "eval": ["eval", copy, "--data", "digits"], "report": ["report", copy],
            "resume": ["run", copy / "config.yaml", "--out", copy, "--resume"]}[command]
    res = _cli(*args)
    assert res.exit_code == 4, res.output
    line = f"error: {copy}: plugin {edited} changed since the run used it (sha256 {_sha(plugin)[:16]} recorded, " \
           f"{_sha(edited)[:16]} now); restore the file the run used"
    assert res.stderr.strip() == line
    assert METHOD not in METHODS and not (tmp_path / "x").exists()


def test_a_vanished_plugin_is_refused_naming_it(run, tmp_path):
    run_dir, plugin = run
    gone = tmp_path / "gone_plugin.py"
    copy = _rerecorded(run_dir, tmp_path, gone, _sha(plugin))
    _fresh()
    res = _cli("export", copy, "--format", "hf", "--out", tmp_path / "x")
    assert res.exit_code == 4, res.output
    assert res.stderr.strip() == (f"error: {copy}: plugin {gone} (sha256 {_sha(plugin)[:16]}), which the run "
                                  "used, is gone; restore it, or pass --plugin FILE holding the same code")
    # the same code under another path, given with --plugin, is the plugin the run used
    res = _cli("export", copy, "--format", "hf", "--out", tmp_path / "y", "--plugin", plugin)
    assert res.exit_code == 0, res.output


def test_a_run_without_a_record_takes_plugin_on_export_and_eval(run, tmp_path):
    run_dir, plugin = run
    copy = tmp_path / "old"
    shutil.copytree(run_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["plugins"]  # a run written before runs recorded their plugins
    (copy / "manifest.json").write_text(json.dumps(manifest))
    _fresh()
    res = _cli("export", copy, "--format", "hf", "--out", tmp_path / "x")
    assert res.exit_code != 0 and "--plugin" in res.stderr and METHOD in res.stderr, res.output
    res = _cli("eval", copy, "--data", "digits", "--plugin", plugin)
    assert res.exit_code == 0 and "loading plugin" not in res.stderr, res.output


MERGE_PLUGIN = textwrap.dedent('''
    import torch
    from clmerge.merging.methods.driver import map_keys
    from clmerge.merging.methods.registry import register_merge
    from clmerge.merging.methods.sources import open_models


    @register_merge("plugin_recorded_median", "plugin test: base + scaling * the median task vector")
    def median_tv(*, base, experts, scaling: float = 1.0):
        def kernel(key, b, xs):
            return b.float() + scaling * torch.stack([x.float() - b.float() for x in xs]).median(dim=0).values

        return map_keys(open_models(base, experts), kernel, needs_base=True)
''')


def test_a_merge_made_with_a_plugin_records_it_in_the_card_and_the_recipe(tmp_path):
    plugin = tmp_path / "merge_plugin.py"
    plugin.write_text(MERGE_PLUGIN)
    paths = []
    for i in range(4):
        save_file({"w": torch.full((2, 3), float(i))}, str(tmp_path / f"e{i}.safetensors"))
        paths += ["--base" if i == 0 else "--expert", tmp_path / f"e{i}.safetensors"]
    try:
        res = _cli("merge", "--plugin", plugin, "--method", "plugin_recorded_median", *paths, "--out", tmp_path / "m")
        assert res.exit_code == 0, res.output
    finally:
        if "plugin_recorded_median" in MERGES:
            MERGES.unregister("plugin_recorded_median")
    recipe = (tmp_path / "m" / "clmerge_recipe.yaml").read_text()
    card = (tmp_path / "m" / "README.md").read_text()
    sha, path = _sha(plugin), plugin.resolve()
    assert f"# plugin {plugin}: {path} sha256 {sha} (re-run with --plugin {path})" in recipe
    assert f"| {plugin} | {path} | `{sha}` |" in card
    assert yaml.safe_load(recipe)["parameters"] == {"scaling": 1.0}  # the plugin method's default, written out
