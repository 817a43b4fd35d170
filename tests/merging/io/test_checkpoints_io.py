"""Checkpoint I/O of ``clmerge merge``: model folders and shards in, complete sharded model folders out."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from checkpoint_helpers import folder_state, invoke, llama_config, save_variants
from safetensors.torch import load_file, save_file

from clmerge import merging
from clmerge.merging.io import open_checkpoint
from clmerge.merging.io.writer import ShardedWriter
from clmerge.merging.methods.sources import ModelSet


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """bf16 Llama base + 2 variants, each saved in 4 KB shards, plus a tokenizer file in the base."""
    tmp = tmp_path_factory.mktemp("llama")
    import transformers as tf

    paths = save_variants(tmp, llama_config(), ["base", "a", "b"], dtype=torch.bfloat16, shard="4KB",
                          auto=tf.AutoModelForCausalLM)
    (paths[0] / "tokenizer.json").write_text('{"from": "base"}')
    return tmp, paths


def test_sharded_bf16_folders_in_sharded_folder_out_loads_equal_to_api(llama, tmp_path):
    import transformers as tf

    _, (base, a, b) = llama
    assert (base / "model.safetensors.index.json").exists()
    out = tmp_path / "merged"
    r = invoke("--method", "ties", "--base", base, "--expert", a, "--expert", b, "--out", out,
               "--set", "density=0.3", "--out-shard-size", "5KB")
    assert r.exit_code == 0, r.output
    want = merging.ties(base=folder_state(base), experts=[folder_state(a), folder_state(b)], density=0.3)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in want.values())
    got = tf.AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert got.keys() == want.keys()
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]) for k in want)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "README.md", "clmerge_recipe.yaml"):
        assert (out / name).exists(), name
    card = (out / "README.md").read_text()
    from clmerge import __version__
    from clmerge.utils.io import sha256_file

    assert __version__ in card and "density: 0.3" in card
    assert sha256_file(base / "model-00001-of-00005.safetensors") in card or "model-00001" not in card
    assert all(sha256_file(f) in card for f in base.glob("*.safetensors"))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_out_dtype_mixed_inputs_and_tokenizer_from(llama, tmp_path):
    import transformers as tf

    _, (base, a, _) = llama
    f32 = tmp_path / "a32"
    tf.AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).save_pretrained(f32)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"from": "tok"}')
    out = tmp_path / "m"
    r = invoke("--method", "task_arithmetic", "--base", base, "--expert", f32, "--expert", a, "--out", out,
               "--set", "scaling=0.5", "--out-dtype", "float32", "--tokenizer-from", tmp_path / "tok")
    assert r.exit_code == 0, r.output
    assert "cast to float32 for the merge" in r.output  # one log line for the mixed dtypes
    sb, s32, sa = folder_state(base), folder_state(f32), folder_state(a)
    got = folder_state(out)
    k = "model.layers.0.mlp.up_proj.weight"
    want = sb[k].float() + 0.5 * ((s32[k] - sb[k].float()) + (sa[k].float() - sb[k].float()))
    assert got[k].dtype == torch.float32 and torch.allclose(got[k], want, atol=1e-6)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert (out / "tokenizer.json").read_text() == '{"from": "tok"}'


def test_bin_shards_and_single_files_read_like_safetensors(llama, tmp_path):
    _, (base, a, b) = llama
    states = [folder_state(p) for p in (a, b)]
    keys = list(states[0])
    binf = tmp_path / "bin"
    binf.mkdir()
    half = len(keys) // 2
    wm = {}
    for i, part in enumerate([keys[:half], keys[half:]]):
        name = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({k: states[0][k] for k in part}, binf / name)
        wm.update({k: name for k in part})
    (binf / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": wm}))
    single = tmp_path / "b.safetensors"
    save_file(states[1], str(single))
    src = open_checkpoint(binf)
    assert src.keys() == keys and torch.equal(src.get(keys[-1]), states[0][keys[-1]])
    want = merging.weight_average(experts=states)
    got = merging.weight_average(experts=[binf, single])
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_streaming_sink_matches_in_memory_ties_with_negative_majority(tmp_path):
    # mostly negative task vectors plus exactly cancelling entries: TIES re-merges the ambiguous keys after
    # its model-wide sign election, which the sink must take as an in-place rewrite
    g = torch.Generator().manual_seed(1)
    base = {f"l.{i}.w": torch.zeros(40, 8) for i in range(3)}
    a = {k: -torch.rand(v.shape, generator=g) for k, v in base.items()}
    bb = {k: -torch.rand(v.shape, generator=g) for k, v in base.items()}
    for k in base:
        a[k][0, :4], bb[k][0, :4] = 2.0, -2.0
    want = merging.ties(base=base, experts=[a, bb], density=0.5, trim_scope="per_tensor")
    plan = [(k, tuple(v.shape), v.dtype) for k, v in base.items()]
    w = ShardedWriter(tmp_path, plan, shard_size=2000)
    ms = ModelSet(base, [a, bb], sink=w)
    merging.ties(base=None, experts=ms, density=0.5, trim_scope="per_tensor").flush()
    w.close()
    got = folder_state(tmp_path)
    assert any((want[k][0, :4] != 0).any() for k in want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def _listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_unsafe_out_is_refused_before_any_work(llama, tmp_path):
    root, (base, a, b) = llama
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("x")
    before = _listing(root), _listing(tmp_path)
    cases = [(a, "inside the input"), (base / "sub", "inside the input"), (tmp_path / "full", "not empty"),
             (tmp_path / "m.pt", "unsupported file suffix"), (tmp_path / "full" / "keep", "not a folder")]
    for out, words in cases:
        r = invoke("--method", "ties", "--base", base, "--expert", a, "--expert", b, "--out", out)
        assert r.exit_code == 5 and words in r.output and r.output.count("\n") == 1, (out, r.output)  # OutputError
    assert (_listing(root), _listing(tmp_path)) == before


def test_hub_id_offline_is_one_fast_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    t = time.perf_counter()
    r = invoke("--method", "weight_average", "--expert", "nobody-xyz/not-a-model", "--out", tmp_path / "o")
    assert time.perf_counter() - t < 10
    assert r.exit_code == 3 and r.output.count("\n") == 1 and "nobody-xyz/not-a-model" in r.output  # InputError
    assert "offline" in r.output and not (tmp_path / "o").exists()


def test_vit_and_bert_merge_to_loadable_folders(tmp_path):
    import transformers as tf

    cfgs = {"vit": tf.ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                image_size=8, patch_size=4),
            "bert": tf.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16)}
    for name, cfg in cfgs.items():
        base, a, b = save_variants(tmp_path / name, cfg, ["base", "a", "b"])
        out = tmp_path / f"{name}_out"
        r = invoke("--method", "task_arithmetic", "--base", base, "--expert", a, "--expert", b, "--out", out)
        assert r.exit_code == 0, r.output
        want = merging.task_arithmetic(base=folder_state(base), experts=[folder_state(a), folder_state(b)])
        got = folder_state(out)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name
        model, info = tf.AutoModel.from_pretrained(out, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary folder left


class _FakeAdapter:
    """Stands in for clmerge.merging.io.peft.AdapterSource (written on another branch): base + 1 on one key."""

    def __init__(self, path, base):
        self.base, self.name, self.files, self.folder = base, str(path), [], path
        self.key = "blk.w"

    def keys(self):
        return self.base.keys()

    def meta(self, key):
        shape, dtype = self.base.meta(key)
        return shape, (torch.float32 if key == self.key else dtype)

    def get(self, key):
        return self.base.get(key).float() + 1.0 if key == self.key else self.base.get(key)


def test_adapter_folders_open_over_the_base_and_merge_in_full(tmp_path, monkeypatch):
    import sys
    import types

    base = {"blk.w": torch.zeros(3, 2, dtype=torch.bfloat16), "blk.b": torch.ones(2, dtype=torch.bfloat16)}
    save_file(base, str(tmp_path / "base.safetensors"))
    for name in ("ad1", "ad2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "clmerge.merging.io.peft", None)  # as if the module were missing
    r = invoke("--method", "task_arithmetic", "--base", tmp_path / "base.safetensors", "--expert", tmp_path / "ad1",
               "--out", tmp_path / "never")
    assert r.exit_code == 3 and "adapter" in r.output and r.output.count("\n") == 1, r.output  # InputError
    fake = types.ModuleType("clmerge.merging.io.peft")
    fake.AdapterSource = _FakeAdapter
    monkeypatch.setitem(sys.modules, "clmerge.merging.io.peft", fake)
    out = tmp_path / "m.safetensors"
    r = invoke("--method", "task_arithmetic", "--base", tmp_path / "base.safetensors", "--expert", tmp_path / "ad1",
               "--expert", tmp_path / "ad2", "--set", "scaling=0.5", "--out", out)
    assert r.exit_code == 0, r.output
    got = load_file(str(out))
    assert got["blk.w"].dtype == torch.bfloat16 and torch.equal(got["blk.w"], torch.ones(3, 2, dtype=torch.bfloat16))
    assert torch.equal(got["blk.b"], base["blk.b"])


def test_threads_2_reads_ahead_and_writes_behind_with_the_same_result(tmp_path):
    # --threads 2: the next key is read in a background thread and the merged one written by another;
    # TIES's re-merge of ambiguous keys (negative majority) must see every pending write first
    g = torch.Generator().manual_seed(2)
    base = {f"l.{i}.w": torch.zeros(30, 8) for i in range(4)}
    ex = [{k: -torch.rand(v.shape, generator=g) for k, v in base.items()} for _ in range(2)]
    for k in base:
        ex[0][k][0, :4], ex[1][k][0, :4] = 2.0, -2.0
    paths = []
    for name, sd in zip(["base", "a", "b"], [base, *ex]):
        save_file(sd, str(tmp_path / f"{name}.safetensors"))
        paths.append(tmp_path / f"{name}.safetensors")
    want = merging.ties(base=base, experts=ex, density=0.5)
    for threads in ("1", "2"):
        out = tmp_path / f"m{threads}"
        r = invoke("--method", "ties", "--base", paths[0], "--expert", paths[1], "--expert", paths[2],
                   "--set", "density=0.5", "--threads", threads, "--out", out, "--out-shard-size", "1500B")
        assert r.exit_code == 0, r.output
        got = folder_state(out)
        assert all(torch.equal(got[k], want[k]) for k in want), threads
    torch.set_num_threads(1)


def test_failed_merge_leaves_no_folder_not_even_new_parents(tmp_path):
    base, ex = {"w": torch.zeros(3)}, [{"w": torch.ones(3)}]
    save_file(base, str(tmp_path / "b.safetensors"))
    save_file(ex[0], str(tmp_path / "e.safetensors"))
    r = invoke("--method", "ties", "--base", tmp_path / "b.safetensors", "--expert", tmp_path / "e.safetensors",
               "--set", "density=2", "--out", tmp_path / "new" / "deeper" / "m")
    assert r.exit_code == 2 and "density" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.safetensors", "e.safetensors"]


def test_sink_view_writes_back_a_tensor_patched_in_place(tmp_path):
    from clmerge.merging.methods.driver import SinkView

    w = ShardedWriter(tmp_path, [("a", (3,), torch.float32), ("b", (2,), torch.float32)])
    view = SinkView(w, ["a", "b"])
    view["a"], view["b"] = torch.zeros(3), torch.zeros(2)
    view["a"][1] = 5.0  # patched in place (as TIES settles ambiguous entries)
    view["b"][0] = 7.0
    view.flush()
    w.close()
    got = folder_state(tmp_path)
    assert got["a"].tolist() == [0.0, 5.0, 0.0] and got["b"].tolist() == [7.0, 0.0]


def test_writer_refuses_nonfinite_tensors_by_name_and_a_rewrite_clears_one(tmp_path):
    from clmerge.merging.methods.sources import MergeInputError

    plan = [("a", (3,), torch.float32), ("b", (2,), torch.float16), ("c", (2,), torch.int64)]
    w = ShardedWriter(tmp_path, plan)
    w.write("a", torch.tensor([1.0, float("nan"), 2.0]))
    w.write("b", torch.tensor([1e5, 1.0]))  # finite in float32, Inf once cast to the planned float16
    w.write("c", torch.tensor([1, 2]))
    with pytest.raises(MergeInputError, match=r"2 merged tensors came out NaN or Inf \('a', 'b'\)"):
        w.close()
    w.abort()
    w = ShardedWriter(tmp_path, plan)
    w.write("a", torch.tensor([1.0, float("inf"), 2.0]))
    w.write("a", torch.tensor([1.0, 3.0, 2.0]))  # rewritten finite (as TIES's sign fix rewrites keys)
    w.write("b", torch.tensor([1.0, 1.0]))
    w.write("c", torch.tensor([1, 2]))
    w.close()


def test_unsupported_dtype_and_key_listed_but_absent_name_file_and_key(tmp_path):
    from clmerge.merging.io.checks import source_get, source_meta
    from clmerge.merging.methods.sources import MergeInputError

    base = {"w": torch.zeros(2, 2)}
    f8 = {"w": torch.ones(2, 2).to(torch.float8_e4m3fn)}
    with pytest.raises(MergeInputError, match=r"expert 0: key 'w' has dtype float8_e4m3fn.*expected F64, F32"):
        ModelSet(base, [f8])

    class Listed(merging.ParamSource):  # lists a key its files do not hold (a stale shard index)
        name = "folder/x"

        def __init__(self):
            pass

        def keys(self):
            return ["w"]

        def meta(self, key):
            raise KeyError(key)

        def get(self, key):
            raise KeyError(key)

    for fn in (source_meta, source_get):
        with pytest.raises(MergeInputError, match=r"^folder/x: key 'w' is listed .* no weights file"):
            fn(Listed(), "w")
    with pytest.raises(MergeInputError, match="folder/x: key 'w'"):
        ModelSet(base, [Listed()])


def test_an_input_that_cannot_be_hashed_is_an_error_not_a_card_without_its_hash(tmp_path):
    # the hashing thread used to die with a stray traceback and the card then said "--no-hash-inputs"
    from clmerge.merging.io import MergeInputError
    from clmerge.merging.io.output import InputHashes

    (tmp_path / "a.safetensors").write_bytes(b"x")
    with pytest.raises(MergeInputError, match="gone.safetensors: cannot read"):
        InputHashes([tmp_path / "a.safetensors", tmp_path / "gone.safetensors"]).get()
    assert list(InputHashes([tmp_path / "a.safetensors"]).get()) == [str(tmp_path / "a.safetensors")]


def test_relative_inputs_are_hashed_from_the_folder_they_were_given_in(tmp_path, monkeypatch):
    import hashlib
    from pathlib import Path

    from clmerge.merging.io import output

    class LateThread:  # runs its target only when joined: the process has moved on by then
        def __init__(self, target, daemon):
            self.target = target

        def start(self):
            pass

        def join(self):
            self.target()

    monkeypatch.setattr(output.threading, "Thread", LateThread)
    (tmp_path / "w.safetensors").write_bytes(b"abc")
    monkeypatch.chdir(tmp_path)
    hashes = output.InputHashes([Path("w.safetensors")])
    os.chdir(tmp_path.parent)
    assert hashes.get() == {"w.safetensors": hashlib.sha256(b"abc").hexdigest()}
