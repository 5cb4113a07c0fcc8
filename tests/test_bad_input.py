"""Bad input gets a one- or two-line error that names the file, line and what to change, before
any model loads or any directory is made; never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from rlvr import cli

ROWS = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(30)]


def _jsonl(path, lines):
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return path


def _cases(tmp_path):
    good = [json.dumps(r) for r in ROWS]
    broken = list(good)
    broken[7] = '{"question": "What is 1 + 1?", "answer": 2,,}'
    latin = list(good)
    latin[5] = good[5].encode().replace(b"What", b"Wh\xe4t")
    empty_prompt = list(good)
    empty_prompt[7] = json.dumps({"question": "  ", "answer": "1"})
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def f(completions, **kw)\n    return [1.0] * len(completions)\n")
    raising = tmp_path / "raising.py"
    raising.write_text("import json\n\nCONFIG = json.loads('{')\n\n\ndef f(completions, **kw):\n    return [1.0]\n")
    return {
        "a malformed JSON line": (f"dataset={_jsonl(tmp_path / 'broken.jsonl', broken)}", "broken.jsonl:8: not valid JSON"),
        "a line that is not UTF-8": (f"dataset={_jsonl(tmp_path / 'latin.jsonl', latin)}", "latin.jsonl:6: not UTF-8 text (byte 0xe4"),
        "an empty file": (f"dataset={_jsonl(tmp_path / 'empty.jsonl', ['', ''])}", "empty.jsonl holds no rows"),
        "an empty prompt on line 8": (f"dataset={_jsonl(tmp_path / 'prompt.jsonl', empty_prompt)}",
                                      "prompt.jsonl:8, column 'question': the prompt is empty"),
        "a reward file with a syntax error": (f"reward_funcs=[{syntax}:f]", "syntax.py:1: expected ':'"),
        "a reward file that raises when imported": (f"reward_funcs=[{raising}:f]", "raising.py:3 raised JSONDecodeError when imported"),
        "an infinite learning rate": ("learning_rate=.inf", "learning_rate must be a finite number > 0; got inf"),
        "a mistyped run directory, offline": ("model=runs/no-such-run", "model 'runs/no-such-run' is not a local directory"),
    }


CASES = ["a malformed JSON line", "a line that is not UTF-8", "an empty file", "an empty prompt on line 8",
         "a reward file with a syntax error", "a reward file that raises when imported", "an infinite learning rate",
         "a mistyped run directory, offline"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_clear_line(case, tiny_model_dir, tmp_path, capsys, monkeypatch):
    import rlvr.models as models

    monkeypatch.setattr(models, "hub_reachable", lambda: False)  # this machine is offline anyway; never wait for it
    setting, message = _cases(tmp_path)[case]
    out = tmp_path / "run"
    args = ["train", f"model={tiny_model_dir}", setting, f"output_dir={out}", "max_steps=1"]
    start = time.perf_counter()
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert len(err.strip().splitlines()) <= 2 and "Traceback" not in err
    assert time.perf_counter() - start < 30
    if "dataset" not in setting:  # found before the run directory is made
        assert not out.exists()


@pytest.mark.processes
def test_python_dash_m_rlvr_is_the_rlvr_command():
    """`python -m rlvr` where the venv's scripts are not on PATH: the same commands, errors and exit codes."""
    run = lambda *args: subprocess.run([sys.executable, "-m", "rlvr", *args], capture_output=True, text=True, timeout=120)  # noqa: E731
    shown = run("--help")
    assert shown.returncode == 0 and "{train,sft,rft,dpo,distill,eval,sample" in shown.stdout
    typo = run("train", "learning_rat=1e-5")
    assert typo.returncode == 2
    assert typo.stderr.strip() == ("rlvr train: error: unknown setting 'learning_rat'; did you mean 'learning_rate'? "
                                   "(see `rlvr train --help` for the list)")


@pytest.mark.parametrize("bad,message", [
    ({"answer": "1"}, "train_dataset row 120, column 'prompt': missing (every row needs a prompt)"),
    ({"prompt": 7, "answer": "1"}, "train_dataset row 120, column 'prompt': the prompt must be text or a list of chat messages, got int"),
])
def test_a_python_api_row_far_into_the_dataset_is_named_before_the_model_loads(bad, message, tiny_model_dir, tmp_path, monkeypatch):
    """Every row is read when GRPOTrainer is made (SFTTrainer: when train() starts), not only the first ones."""
    from datasets import Dataset

    import rlvr.models
    import rlvr.run
    from rlvr import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
    from rlvr.tasks.dataset import DatasetError

    for module in (rlvr.models, rlvr.run):
        monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(150)]
    rows[120] = bad
    for dataset in (rows, Dataset.from_list(rows)) if "prompt" not in bad else (rows,):  # a Dataset holds one type a column
        with pytest.raises(DatasetError) as caught:
            GRPOTrainer(model=str(tiny_model_dir), reward_funcs="boxed_format", train_dataset=dataset,
                        args=GRPOConfig(output_dir=str(tmp_path / "grpo")))
        assert str(caught.value).startswith(message) and "\n" not in str(caught.value)
    demos = [{"completion" if k == "answer" else k: v for k, v in row.items()} for row in rows]
    trainer = SFTTrainer(model=str(tiny_model_dir), train_dataset=demos, args=SFTConfig(output_dir=str(tmp_path / "sft")))
    with pytest.raises(DatasetError, match=r"^train_dataset row 120(, column 'prompt')?: (missing|the prompt must be)"):
        trainer.train()
