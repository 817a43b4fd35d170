"""The verifier (clmerge.merging.io.verify, ``clmerge verify``): each failure class that users report of merged
models (missing q_norm/k_norm, a duplicated or missing lm_head, a truncated vocabulary, an added token without
a row, a dropped chat template, changed special tokens, stray dtypes, NaN) reproduced on a tiny model and caught;
a clean folder passes; a merge whose output fails is never moved into place (exit 3); every output kind of the
runner goes through the one writer's verification."""

from __future__ import annotations

import ast
import json
import shutil
import typing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.merging.io.verify import VerificationError, verify_folder
from vocab_helpers import CORE, tiny_tokenizer

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
EMB, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _save(folder: Path, model, tok) -> Path:
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def qwen3(folder: Path, *, seed: int = 0, tie: bool = True, added: tuple = ()) -> Path:
    """A tiny Qwen3 (q_norm/k_norm in every layer), bf16, with a tokenizer and a chat template."""
    import transformers as tf

    torch.manual_seed(seed)
    tok = tiny_tokenizer(CORE, list(added), TEMPLATE)
    cfg = tf.Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tie,
                         bos_token_id=1, eos_token_id=2)
    return _save(folder, tf.Qwen3ForCausalLM(cfg).to(torch.bfloat16), tok)


def llama(folder: Path, *, seed: int = 0) -> Path:
    """A tiny untied Llama, float32, with a tokenizer and a chat template."""
    import transformers as tf

    torch.manual_seed(seed)
    tok = tiny_tokenizer(CORE, [], TEMPLATE)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    return _save(folder, tf.LlamaForCausalLM(cfg), tok)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test starts with an empty verification cache of its own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("verify_zoo")
    qwen3(d / "qwen")
    qwen3(d / "qwen_ft", seed=1)
    llama(d / "llama")
    llama(d / "llama_ft", seed=1)
    return d


def damaged(src: Path, dst: Path, *, tensors=None, config=None, tok_config=None) -> Path:
    """A copy of ``src`` with its weights, config or tokenizer config edited."""
    shutil.copytree(src, dst)
    if tensors is not None:
        sd = load_file(dst / "model.safetensors")
        save_file(tensors(dict(sd)), dst / "model.safetensors", metadata={"format": "pt"})
    for name, edit in (("config.json", config), ("tokenizer_config.json", tok_config)):
        if edit is not None:
            data = json.loads((dst / name).read_text())
            (dst / name).write_text(json.dumps(edit(data)))
    return dst


def problems(v) -> str:
    return "\n".join(v.problems)


def test_a_saved_model_passes_every_check(zoo):
    for name in ("qwen", "llama"):
        v = verify_folder(zoo / name, against=zoo / name)
        assert v.ok, problems(v)
        assert set(v.checks) == {"weights", "transformers reload", "dtypes", "finite", "tied embeddings",
                                 "tokenizer rows", "special tokens", "chat template"}
        assert all(s.startswith("passed") for s in v.checks.values()), v.checks


def test_missing_q_norm_and_k_norm_are_named_from_transformers_loading_info(zoo, tmp_path):
    bad = damaged(zoo / "qwen", tmp_path / "no_norm",
                  tensors=lambda sd: {k: v for k, v in sd.items() if "q_norm" not in k and "k_norm" not in k})
    v = verify_folder(bad)
    assert not v.ok and v.checks["transformers reload"] == "failed"
    text = problems(v)
    assert "model.layers.{0, 1}.self_attn.q_norm.weight" in text and "k_norm" in text
    assert "initialise them at random" in text


def test_transformers_answer_is_cached_per_config_and_tensor_names_shapes_and_dtypes(zoo, tmp_path, monkeypatch):
    from clmerge.merging.io import verify as verify_mod

    drop = dict(tensors=lambda sd: {k: v for k, v in sd.items() if "q_norm" not in k})
    first = verify_folder(damaged(zoo / "qwen", tmp_path / "a", **drop))
    assert first.checks["transformers reload"] == "failed"

    def no_load(*args, **kwargs):
        raise AssertionError("transformers was asked again for an answer the cache holds")

    real_load = verify_mod._load
    monkeypatch.setattr(verify_mod, "_load", no_load)
    again = verify_folder(damaged(zoo / "qwen", tmp_path / "b", **drop))  # same names, shapes, dtypes, config
    assert again.problems == first.problems
    monkeypatch.setattr(verify_mod, "_load", real_load)
    assert verify_folder(zoo / "qwen").checks["transformers reload"] == "passed"  # other tensors: loaded anew
    assert verify_folder(zoo / "qwen").checks["transformers reload"] == "passed (cached loading info)"


def test_the_cache_is_not_used_with_clmerge_verify_cache_0(zoo, monkeypatch):
    from clmerge.merging.io import verify as verify_mod

    monkeypatch.setenv("CLMERGE_VERIFY_CACHE", "0")
    verify_folder(zoo / "llama")
    calls = []
    real = verify_mod._load
    monkeypatch.setattr(verify_mod, "_load", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert verify_folder(zoo / "llama").checks["transformers reload"] == "passed" and calls == [1]


def test_a_duplicated_lm_head_that_differs_under_tied_embeddings_is_caught(zoo, tmp_path):
    bad = damaged(zoo / "qwen", tmp_path / "dup", tensors=lambda sd: {**sd, HEAD: sd[EMB] * 2})
    v = verify_folder(bad)
    assert v.checks["tied embeddings"] == "failed"
    assert "tie_word_embeddings is true but lm_head.weight is stored and differs" in problems(v)


def test_an_lm_head_stored_equal_under_tied_embeddings_passes_with_a_note(zoo, tmp_path):
    ok = damaged(zoo / "qwen", tmp_path / "dup_equal", tensors=lambda sd: {**sd, HEAD: sd[EMB].clone()})
    v = verify_folder(ok)
    assert v.ok, problems(v)
    assert any("equals model.embed_tokens.weight" in n for n in v.notes)


def test_a_missing_lm_head_of_an_untied_model_is_caught(zoo, tmp_path):
    bad = damaged(zoo / "llama", tmp_path / "no_head", tensors=lambda sd: {k: v for k, v in sd.items() if k != HEAD})
    v = verify_folder(bad)
    assert v.checks["tied embeddings"] == "failed" and v.checks["transformers reload"] == "failed"
    assert "tie_word_embeddings is false but lm_head.weight is missing" in problems(v)


def test_a_truncated_vocabulary_is_caught_even_with_a_consistent_config(zoo, tmp_path):
    rows = len(CORE) - 3
    bad = damaged(zoo / "llama", tmp_path / "trunc", tensors=lambda sd: {**sd, EMB: sd[EMB][:rows].clone(),
                                                                         HEAD: sd[HEAD][:rows].clone()},
                  config=lambda c: {**c, "vocab_size": rows})
    v = verify_folder(bad)
    assert v.checks["tokenizer rows"] == "failed"
    assert f"has ids 0..{len(CORE) - 1} but model.embed_tokens.weight has {rows} rows: a truncated vocabulary" \
        in problems(v)


def test_rows_fewer_than_the_config_says_are_newly_initialised_in_transformers(zoo, tmp_path):
    rows = len(CORE) - 3
    bad = damaged(zoo / "llama", tmp_path / "trunc_cfg", tensors=lambda sd: {**sd, EMB: sd[EMB][:rows].clone()})
    v = verify_folder(bad)
    assert f"model.embed_tokens.weight is [{rows}, 16], the config implies [{len(CORE)}, 16]" in problems(v)


def test_an_added_token_without_a_row_is_caught(zoo, tmp_path):
    src = qwen3(tmp_path / "added", added=("<tool>",))  # vocab_size counts <tool>
    rows = len(CORE)
    bad = damaged(src, tmp_path / "added_bad", tensors=lambda sd: {**sd, EMB: sd[EMB][:rows].clone()},
                  config=lambda c: {**c, "vocab_size": rows})
    v = verify_folder(bad)
    assert v.checks["tokenizer rows"] == "failed"
    assert f"1 added token(s) have no row in model.embed_tokens.weight ({rows} rows): '<tool>' (id {rows})" \
        in problems(v)


def test_a_dropped_chat_template_is_caught_against_the_base(zoo, tmp_path):
    bad = damaged(zoo / "qwen", tmp_path / "no_template",
                  tok_config=lambda c: {k: v for k, v in c.items() if k != "chat_template"})
    (bad / "chat_template.jinja").unlink(missing_ok=True)
    v = verify_folder(bad, against=zoo / "qwen")
    assert v.checks["chat template"] == "failed"
    assert "the chat template of the reference" in problems(v) and "was dropped" in problems(v)
    assert verify_folder(bad).checks["chat template"].startswith("skipped")  # no reference: nothing to compare


def test_a_changed_special_token_is_caught_against_the_base(zoo, tmp_path):
    bad = damaged(zoo / "qwen", tmp_path / "eos", tok_config=lambda c: {**c, "eos_token": "w3"})
    v = verify_folder(bad, against=zoo / "qwen")
    assert v.checks["special tokens"] == "failed"
    assert "eos_token is '</s>' in the reference" in problems(v)


def test_a_tensor_of_another_dtype_than_the_config_is_caught(zoo, tmp_path):
    key = "model.norm.weight"
    bad = damaged(zoo / "qwen", tmp_path / "dtype", tensors=lambda sd: {**sd, key: sd[key].float()})
    v = verify_folder(bad)
    assert v.checks["dtypes"] == "failed" and f"{key} (float32)" in problems(v)
    assert verify_folder(bad, against=bad).checks["dtypes"] == "passed"  # as in the reference: accepted


def test_nan_is_caught_when_the_folder_is_read(zoo, tmp_path):
    key = "model.layers.0.mlp.up_proj.weight"
    bad = damaged(zoo / "llama", tmp_path / "nan", tensors=lambda sd: {**sd, key: sd[key].clone().fill_(float("nan"))})
    v = verify_folder(bad)
    assert v.checks["finite"] == "failed" and key in problems(v)


def test_an_unexpected_tensor_is_named(zoo, tmp_path):
    bad = damaged(zoo / "llama", tmp_path / "extra", tensors=lambda sd: {**sd, "model.extra.weight": torch.ones(3)})
    v = verify_folder(bad)
    assert "model.extra.weight" in problems(v) and "unexpected" in problems(v)


def test_the_command_prints_each_check_and_exits_3_on_a_failure(zoo, tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["verify", str(zoo / "qwen"), "--against", str(zoo / "qwen")])
    assert res.exit_code == 0, res.output
    assert "transformers reload" in res.output and "verification passed" in res.output
    bad = damaged(zoo / "qwen", tmp_path / "no_norm",
                  tensors=lambda sd: {k: v for k, v in sd.items() if "q_norm" not in k})
    res = runner.invoke(app, ["verify", str(bad), "--json"])
    assert res.exit_code == 3
    assert json.loads(res.stdout[: res.stdout.rindex("}") + 1])["ok"] is False


def adapters(d: Path) -> tuple[Path, Path, Path]:
    """A tiny Llama base folder and two peft LoRA adapters on it (random non-zero factors)."""
    peft = pytest.importorskip("peft")
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    tf.LlamaModel(cfg).save_pretrained(d / "base")
    for name, seed in (("a1", 1), ("a2", 2)):
        model = peft.get_peft_model(tf.LlamaModel(cfg), peft.LoraConfig(r=4, lora_alpha=8,
                                                                        target_modules=["q_proj", "v_proj"]))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        model.save_pretrained(d / name)
    return d / "base", d / "a1", d / "a2"


# --- merges: verified before they are moved into place ---


def merge(*args):
    return CliRunner().invoke(app, ["merge", *map(str, args), "--no-hash-inputs"])


def test_a_merge_records_its_verification_in_the_model_card(zoo, tmp_path):
    out = tmp_path / "m"
    res = merge("--method", "task_arithmetic", "--base", zoo / "qwen", "--expert", zoo / "qwen_ft", "--out", out)
    assert res.exit_code == 0, res.output
    card = (out / "README.md").read_text()
    # the output has the base's config and tensor names and shapes: answered from the base, not loaded again
    assert "## Verification" in card and "| transformers reload | passed (the reference's config" in card
    assert "verification passed" in res.output
    assert verify_folder(out).checks["transformers reload"] == "passed"  # clmerge verify loads it


def test_a_merge_of_one_architecture_imports_no_transformers(zoo, tmp_path):
    """The verification's cost on a first merge (empty cache): the reload check of an output with its base's
    architecture is answered from the base, and no warm-up imports transformers in the background."""
    import os
    import subprocess
    import sys

    code = ("import sys; from typer.testing import CliRunner; from clmerge.cli import app; "
            f"r = CliRunner().invoke(app, ['merge', '--method', 'task_arithmetic', '--base', {str(zoo / 'qwen')!r}, "
            f"'--expert', {str(zoo / 'qwen_ft')!r}, '--out', {str(tmp_path / 'm')!r}, '--no-hash-inputs']); "
            "import time; time.sleep(0.5); "  # a background import would have begun by now
            "print(r.exit_code, 'transformers.modeling_utils' in sys.modules)")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.split()[-2:] == ["0", "False"], out.stdout + out.stderr
    assert not list((tmp_path / "cache").rglob("*.json"))  # nothing loaded, nothing cached


def test_an_auto_reload_loads_a_folder_whose_architecture_differs_from_the_reference(zoo, tmp_path):
    bad = damaged(zoo / "qwen", tmp_path / "no_norm",
                  tensors=lambda sd: {k: v for k, v in sd.items() if "q_norm" not in k})
    v = verify_folder(bad, against=zoo / "qwen", reload="auto")
    assert v.checks["transformers reload"] == "failed" and "q_norm" in problems(v)
    with pytest.raises(ValueError, match="reload must be"):
        verify_folder(zoo / "qwen", reload="sometimes")


def test_a_merge_whose_output_fails_verification_is_not_moved_into_place(zoo, tmp_path, monkeypatch):
    from clmerge.merging.io import output

    assert (zoo / "qwen" / "chat_template.jinja").exists()
    # a writer bug: the chat template is no longer copied
    monkeypatch.setattr(output, "TOKENIZER_FILES", [n for n in output.TOKENIZER_FILES if n != "chat_template.jinja"])
    out = tmp_path / "m"
    res = merge("--method", "weight_average", "--base", zoo / "qwen", "--expert", zoo / "qwen_ft", "--out", out)
    assert res.exit_code == 3, res.output
    assert "verification failed" in res.output and "chat template" in res.output and "was dropped" in res.output
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".m.")]  # no staging folder left


def test_what_the_base_itself_reports_is_a_note_not_a_failure(zoo, tmp_path):
    # every input lacks q_norm / k_norm: the merge reproduces its base, it does not lose them
    drop = dict(tensors=lambda sd: {k: v for k, v in sd.items() if "q_norm" not in k and "k_norm" not in k})
    base = damaged(zoo / "qwen", tmp_path / "b", **drop)
    ft = damaged(zoo / "qwen_ft", tmp_path / "f", **drop)
    out = tmp_path / "m"
    res = merge("--method", "weight_average", "--base", base, "--expert", ft, "--out", out)
    assert res.exit_code == 0, res.output
    card = (out / "README.md").read_text()
    # the output has the base's architecture: the reload check is the base's, not asked again in the merge
    assert "transformers was not asked about" in card and "| transformers reload | passed (the reference's" in card
    assert not verify_folder(out).ok  # alone, without the base, the folder still fails
    v = verify_folder(out, against=base)  # clmerge verify --against: loaded, the base's gaps are notes
    assert v.ok and v.checks["transformers reload"].startswith("passed")
    assert "missing key(s) in the reference too (not introduced here)" in "\n".join(v.notes)
    assert "q_norm" in "\n".join(v.notes)
    # with the base's loading info cached (it was just loaded), a merge's check inherits its notes
    from clmerge.merging.io.verify import _architecture

    out2 = tmp_path / "m2"
    assert merge("--method", "weight_average", "--base", base, "--expert", ft, "--out", out2, "--out-dtype",
                 "float32").exit_code == 0
    card2 = (out2 / "README.md").read_text()
    assert "missing key(s) in the reference too (not introduced here)" in card2 and "loaded as" in card2
    assert _architecture(json.loads((out2 / "config.json").read_text()), {}) == \
        _architecture(json.loads((base / "config.json").read_text()), {})


def test_an_adapter_merge_is_verified(tmp_path):
    base, a1, a2 = adapters(tmp_path)
    out = tmp_path / "merged_adapter"
    res = merge("--method", "task_arithmetic", "--base", base, "--expert", a1, "--expert", a2, "--out", out,
                "--adapter-out", "factored")
    assert res.exit_code == 0, res.output
    report = json.loads((out / "merge_report.json").read_text())
    assert report["verification"]["ok"] and report["verification"]["kind"] == "adapter"
    assert report["verification"]["checks"]["base shapes"] == "passed"


def test_adapter_folders_with_a_wrong_rank_or_an_untargeted_module_are_caught(tmp_path):
    base, a1, _ = adapters(tmp_path)
    assert verify_folder(a1, against=base).ok
    bad = tmp_path / "bad_rank"
    shutil.copytree(a1, bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "r": cfg["r"] + 1,
                                                         "target_modules": ["q_proj"]}))
    v = verify_folder(bad, against=base)
    assert v.checks["ranks"] == "failed" and v.checks["target modules"] == "failed"
    assert "not in target_modules" in problems(v)


# --- the one writer: no output kind bypasses the verification ---

SRC = Path(__file__).resolve().parents[2] / "src" / "clmerge"
# the constructors that write an output folder; only OutputFolder (and build_folder) verify before the move
_WRITERS = {"OutputTarget", "ShardedWriter"}
_ALLOWED = {("merging/run.py", "OutputTarget"): "intermediate_folder: a stage's scratch folder, never moved "
                                                 "into place (each stage's output is an OutputFolder)"}


def test_no_module_builds_an_output_folder_but_the_one_writer():
    found = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel == "merging/io/output.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in _WRITERS and (rel, name) not in _ALLOWED:
                    found.append(f"{rel}:{node.lineno} {name}")
    assert not found, ("write outputs through OutputFolder (or build_folder), which verifies them before the "
                       f"move into place: {found}")


def test_every_kind_of_run_has_a_verified_output_test():
    from clmerge.merging.run import Plan

    kinds = set(typing.get_args(typing.get_type_hints(Plan)["kind"]))
    covered = {"models": "test_a_merge_records_its_verification_in_the_model_card",
               "adapters": "test_an_adapter_merge_is_verified",
               "stages": "test_stages_and_slices_are_verified",
               "slices": "test_stages_and_slices_are_verified",
               "moe": "test_an_moe_is_verified"}
    assert kinds <= set(covered), f"a new kind of run needs a test that its output is verified: {kinds - set(covered)}"
    assert all(name in globals() for name in covered.values())


def test_stages_and_slices_are_verified(zoo, tmp_path):
    import yaml

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "stages": [{"name": "s1", "method": "weight_average", "models": [{"model": str(zoo / "llama")},
                                                                         {"model": str(zoo / "llama_ft")}]}],
        "method": "task_arithmetic", "base": str(zoo / "llama"), "models": [{"model": "s1"}]}))
    res = merge(recipe, "--out", tmp_path / "staged")
    assert res.exit_code == 0, res.output
    assert res.output.count("verification passed") == 2  # the stage and the final merge
    recipe.write_text(yaml.safe_dump({"method": "passthrough", "slices": [
        {"sources": [{"model": str(zoo / "llama"), "layer_range": [0, 2]}]},
        {"sources": [{"model": str(zoo / "llama_ft"), "layer_range": [1, 2]}]}]}))
    res = merge(recipe, "--out", tmp_path / "sliced")
    assert res.exit_code == 0, res.output
    assert "| transformers reload | passed |" in (tmp_path / "sliced" / "README.md").read_text()


def test_an_moe_is_verified(zoo, tmp_path):
    import yaml

    recipe = tmp_path / "moe.yaml"
    recipe.write_text(yaml.safe_dump({"base_model": str(zoo / "llama"), "gate_mode": "random",
                                      "experts": [{"source_model": str(zoo / "llama")},
                                                  {"source_model": str(zoo / "llama_ft")}]}))
    res = CliRunner().invoke(app, ["moe", str(recipe), "--out", str(tmp_path / "moe"), "--no-hash-inputs"])
    assert res.exit_code == 0, res.output
    assert "## Verification" in (tmp_path / "moe" / "README.md").read_text()


def test_verification_error_is_an_input_error_with_exit_code_3():
    from clmerge.merging.io.verify import Verification

    v = Verification("x")
    v.fail("finite", "a")
    v.fail("dtypes", "b")
    err = VerificationError(v)
    assert err.exit_code == 3 and str(err) == "x: verification failed (2 problems): finite: a; dtypes: b"


def test_the_background_import_starts_only_where_the_output_changes_the_architecture(zoo, monkeypatch):
    from clmerge.merging.io import output, verify
    from clmerge.merging.io.readers import open_checkpoint as open_source

    started = []
    monkeypatch.setattr(verify, "warm_up", lambda config, tensors=None: started.append(config["model_type"]))
    same = [open_source(zoo / "qwen"), open_source(zoo / "qwen_ft")]
    output._warm_verifier(same)
    assert started == []  # one architecture: the reload check is answered from the base
    output._warm_verifier(same, always=True)  # an MoE or a layer stack: transformers will be asked
    output._warm_verifier([open_source(zoo / "qwen"), open_source(zoo / "llama")])  # two architectures
    assert started == ["qwen3", "qwen3"]
