"""Extension points (docs/extending.md): a custom method needs no ``super()`` calls for the base class's
duties, and ``clmerge run --plugin`` imports a user's module (by file path or name) before the config is read,
so the method it registers can be run by name."""

from __future__ import annotations

import json
import textwrap

import pytest
import yaml
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.config import parse_config
from clmerge.engine.run import run_experiment
from clmerge.methods.base import METHODS, ContinualMethod, register_method
from conftest import tiny_config

PLUGIN = textwrap.dedent('''
    """A tiny method: a frozen backbone, only the head trains; no super() calls anywhere."""
    from clmerge.methods.base import ContinualMethod, MethodOptions, register_method


    class HeadOnlyOptions(MethodOptions):
        scale: float = 1.0


    @register_method
    class HeadOnly(ContinualMethod):
        name = "{name}"
        description = "plugin test: train the head only"
        Options = HeadOnlyOptions

        def setup(self, model):
            model.backbone.requires_grad_(False)

        def end_task(self, task, ctx):
            self.record("scale", self.options.scale)
''')


@pytest.fixture()
def unregister():
    """Names registered by a test are removed afterwards (the registry is process-wide)."""
    names: list[str] = []
    yield names
    for n in names:
        METHODS.unregister(n)


class _FrozenNoSuperSetup(ContinualMethod):
    def setup(self, model):  # no super().setup(model): self.model must be set anyway
        model.backbone.requires_grad_(False)


class _NoSuperBegin(ContinualMethod):
    def begin_task(self, task, ctx):  # no super().begin_task: the head must grow anyway
        self.began = task.index


class _NoSuperAtAll(_FrozenNoSuperSetup, _NoSuperBegin):
    pass


@pytest.mark.parametrize("base", [_FrozenNoSuperSetup, _NoSuperBegin, _NoSuperAtAll],
                         ids=["setup", "begin_task", "both"])
def test_method_overriding_hooks_without_super_runs(tmp_path, unregister, base):
    cls = register_method(type(f"T{base.__name__}", (base,), {"name": f"test_no_super_{base.__name__.lower()}"}))
    unregister.append(cls.name)
    metrics = run_experiment(parse_config(tiny_config(method={"name": cls.name})), tmp_path / "run")
    assert len(metrics["accuracy_matrix"]) == 2 and metrics["accuracy_matrix"][1][1] is not None


def test_init_without_super_is_a_clear_error(tmp_path, unregister):
    @register_method
    class NoInit(ContinualMethod):
        name = "test_no_init"

        def __init__(self, options, *, seed=0):
            self.opts = options

    unregister.append(NoInit.name)
    with pytest.raises(TypeError, match=r"must call super\(\).__init__"):
        run_experiment(parse_config(tiny_config(method={"name": NoInit.name})), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def _workspace(tmp_path, name: str) -> None:
    (tmp_path / "my_plugin.py").write_text(PLUGIN.format(name=name))
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_config(method={"name": name, "scale": 0.5})))


def test_plugin_file_registers_a_method_that_runs_two_tasks_on_digits(tmp_path, monkeypatch, unregister):
    unregister.append("plugin_head_only")
    _workspace(tmp_path, "plugin_head_only")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "tiny.yaml", "--plugin", "./my_plugin.py", "--out", "r"])
    assert result.exit_code == 0, result.output
    metrics = json.loads((tmp_path / "r" / "metrics.json").read_text())
    assert metrics["method"] == "plugin_head_only" and metrics["dataset"] == "digits"
    assert len(metrics["accuracy_matrix"]) == 2 and metrics["accuracy_matrix"][1][1] is not None
    assert metrics["method_metrics"]["scale"] == [0.5, 0.5]
    assert not (tmp_path / "__pycache__").exists()


def test_plugin_by_module_name(tmp_path, monkeypatch, unregister):
    unregister.append("plugin_by_name")
    _workspace(tmp_path, "plugin_by_name")
    (tmp_path / "my_plugin.py").rename(tmp_path / "clmerge_test_plugin_mod.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "tiny.yaml", "--plugin", "clmerge_test_plugin_mod", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "plugin_by_name" in METHODS


def test_without_the_plugin_the_method_is_unknown(tmp_path, monkeypatch):
    _workspace(tmp_path, "plugin_not_loaded")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "tiny.yaml", "--out", "r"])
    assert result.exit_code == 2 and "plugin_not_loaded" in result.stderr


def _image_tree(root, classes: list[str], n: int = 6) -> None:
    import numpy as np
    from PIL import Image

    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(n):
            arr = np.full((12, 14, 3), 20 * c + i, dtype=np.uint8)
            Image.fromarray(arr).save(root / name / f"{i}.{'png' if i % 2 else 'bmp'}")


def test_image_folder_class_names_reach_the_manifest_and_the_report(tmp_path):
    classes = ["ant", "bee", "cat", "dog<b>"]
    _image_tree(tmp_path / "data", classes)
    cfg = tiny_config(**{"scenario.dataset": "image_folder", "scenario.data_root": str(tmp_path / "data"),
                         "scenario.train_per_class": None, "scenario.test_per_class": None,
                         "scenario.shuffle_classes": False, "run.report": True})
    run_experiment(parse_config(cfg), tmp_path / "run")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["class_names"] == classes
    html = (tmp_path / "run" / "report.html").read_text()
    assert "<th>class names</th>" in html
    assert "<td>ant, bee</td>" in html and "<td>cat, dog&lt;b&gt;</td>" in html


def test_image_folder_reads_tiff_gif_and_netpbm(tmp_path):
    import numpy as np
    from PIL import Image

    from clmerge.data.folders import image_folder

    for c, name in enumerate(["a", "b"]):
        (tmp_path / name).mkdir()
        for i, ext in enumerate(["tif", "gif", "ppm", "tga", "png"]):
            Image.fromarray(np.full((9, 11, 3), 40 * c + i, dtype=np.uint8)).save(tmp_path / name / f"{i}.{ext}")
    splits = image_folder(data_root=tmp_path, image_size=8, test_fraction=0.2)
    assert splits.class_names == ["a", "b"] and len(splits.train) + len(splits.test) == 10
    x, _ = splits.train.get_batch(np.arange(len(splits.train)))
    assert x.shape[1:] == (3, 8, 8)
