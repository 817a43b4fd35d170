"""The input boundary (utils.inpaths) and the output guard's naming helpers (utils.outpaths.child / slug), case
by case: each hostile input of the classes an outside test found is refused with one line naming the path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from clmerge.errors import InputError, OutputError
from clmerge.utils import inpaths
from clmerge.utils.outpaths import MAX_NAME, child, slug


@pytest.fixture()
def tree(tmp_path):
    m = tmp_path / "m"
    (m / "sub").mkdir(parents=True)
    (tmp_path / "secret.json").write_text('{"secret": 1}')
    (m / "ok.json").write_text('{"ok": 1}')
    (m / "sub" / "in.json").write_text('{"in": 1}')
    os.symlink(tmp_path / "secret.json", m / "abs_out.json")
    os.symlink("../secret.json", m / "rel_out.json")
    os.symlink("sub/in.json", m / "link_in.json")
    os.symlink(tmp_path, m / "dir_out")
    os.symlink("loop.json", m / "loop.json")
    os.mkfifo(m / "fifo.json")
    with open(m / "sparse.json", "wb") as fh:
        fh.truncate(3 << 30)  # 3 GiB, no blocks: must be refused from its size
    return m


@pytest.mark.parametrize(("entry", "error", "words"), [
    ("abs_out.json", InputError, "points outside"),
    ("rel_out.json", InputError, "points outside"),
    ("dir_out/secret.json", InputError, "points outside"),
    ("../secret.json", InputError, "points outside"),
    ("loop.json", InputError, "symlink loop"),
    ("fifo.json", InputError, "FIFO"),
    ("sub", InputError, "folder"),
    ("sparse.json", inpaths.InputTooLarge, "over the"),
    ("missing.json", inpaths.InputMissing, "no such file"),
])
def test_refused(tree, entry, error, words):
    with pytest.raises(error, match=words) as info:
        inpaths.read_json(tree / entry, within=tree)
    assert "\n" not in str(info.value) and entry.split("/")[-1] in str(info.value)


@pytest.mark.parametrize(("entry", "value"), [("ok.json", {"ok": 1}), ("link_in.json", {"in": 1}),
                                              ("sub/in.json", {"in": 1})])
def test_read_inside(tree, entry, value):
    assert inpaths.read_json(tree / entry, within=tree) == value


def test_user_path_is_not_contained_but_still_checked(tree):
    assert inpaths.read_json(tree / "abs_out.json") == {"secret": 1}  # the user named it: followed
    with pytest.raises(InputError, match="FIFO"):
        inpaths.read_json(tree / "fifo.json")


def test_cap_holds_while_reading(tmp_path):
    """A file that holds more than its stat said (a /proc file, one being appended to) is never read past the
    cap: /proc/self/maps reports size 0."""
    with pytest.raises(inpaths.InputTooLarge, match="holds more than"):
        inpaths.read_bytes("/proc/self/maps", max_bytes=8)


def test_strict_json_refuses_non_numbers(tmp_path):
    (tmp_path / "m.json").write_text('{"acc": Infinity}')
    assert inpaths.read_json(tmp_path / "m.json") == {"acc": float("inf")}
    with pytest.raises(InputError, match="Infinity"):
        inpaths.read_json(tmp_path / "m.json", strict=True)


def test_checked_path_names_the_checked_file(tree):
    with inpaths.checked_path(tree / "link_in.json", within=tree) as p:
        os.replace(tree / "ok.json", tree / "sub" / "in.json")  # swapped after the check: the descriptor holds
        assert Path(p).read_text() == '{"in": 1}'
    with pytest.raises(InputError, match="points outside"):
        with inpaths.checked_path(tree / "abs_out.json", within=tree):
            pass


def test_hub_snapshot_may_link_into_its_blobs(tmp_path):
    repo = tmp_path / "models--org--name"
    snap, blobs = repo / "snapshots" / "abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "1234").write_text("{}")
    os.symlink("../../blobs/1234", snap / "config.json")
    assert inpaths.read_json(snap / "config.json", within=snap) == {}


def test_real_subdirs_skips_links(tree):
    kept, links = inpaths.real_subdirs(tree)
    assert kept == [tree / "sub"] and tree / "dir_out" in links and tree / "loop.json" in links


@pytest.mark.parametrize("name", ["..", ".", "", "a/b", "dir_out", "abs_out.json", "fifo.json"])
def test_child_refuses(tree, name):
    with pytest.raises(OutputError):
        child(tree, name)


def test_child_allows_new_and_real(tree):
    assert child(tree, "new.html") == tree / "new.html" and child(tree, "sub") == tree / "sub"


@pytest.mark.parametrize(("value", "same"), [("pm", True), ("pm-seed1", True), ("0.001", True),
                                             ("..", False), (".", False), (".hidden", False), ("a/b", False),
                                             ("x" * 300, False), ("a b", False), ("pm-h0123456789ab", False)])
def test_slug(value, same):
    s = slug(value)
    assert (s == value) is same
    assert s not in (".", "..") and "/" not in s and len(s) <= MAX_NAME and not s.startswith(".")


def test_slug_is_injective_on_lookalikes():
    values = ["a/b", "a_b", "a b", "a:b", "..", "._", "x" * 300, "x" * 301, "pm", "pm-h" + "0" * 12,
              slug("a/b"), slug("x" * 300)]
    assert len({slug(v) for v in values}) == len(values)
