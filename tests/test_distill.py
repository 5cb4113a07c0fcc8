"""On-policy distillation (rlvr distill, DistillationTrainer; distill.py): the divergence by hand, against
TRL's own loss on the same tensors, a teacher that is the student, the mixed objective against GRPO's
update, the settings, and a tiny student that learns a task from a teacher trained on it."""

import copy
import json
import math

import pytest
import torch

from conftest import make_tiny_model, make_tokenizer
from test_update import _policy_update, _two_completions
from rlvr.config import ConfigError, build_config
from rlvr.distill import Distillation, Head, Teacher, hidden_terms, token_divergence
from rlvr.losses import LossNorm


def _logp(*logits):
    return torch.log_softmax(torch.tensor([logits], dtype=torch.float64), dim=-1)


# Student logits (0, 0): p_s = (1/2, 1/2); teacher logits (ln 3, 0): p_t = (3/4, 1/4).
S, T = _logp(0.0, 0.0), _logp(math.log(3.0), 0.0)
REVERSE = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # KL(p_s || p_t) = 0.143841
FORWARD = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # KL(p_t || p_s) = 0.130812
# beta = 0.5: m = (0.625, 0.375); 0.5 KL(p_t || m) + 0.5 KL(p_s || m)
JSD = 0.5 * (0.75 * math.log(0.75 / 0.625) + 0.25 * math.log(0.25 / 0.375)) + \
      0.5 * (0.5 * math.log(0.5 / 0.625) + 0.5 * math.log(0.5 / 0.375))  # 0.033822


@pytest.mark.parametrize("beta, expected", [(1.0, REVERSE), (0.0, FORWARD), (0.5, JSD)])
def test_the_divergence_of_one_position_by_hand(beta, expected):
    assert token_divergence(S, T, beta).item() == pytest.approx(expected, abs=1e-12)
    assert token_divergence(T, T, beta).item() == pytest.approx(0.0, abs=1e-12)


def test_a_two_token_completion_loss_and_gradient_by_hand():
    """Two positions through identity heads (hidden state = logits): position 1 as above, position 2 where the
    student is (ln 3, 0) and the teacher (0, 0).  Reverse KL; the loss is the token mean, the gradient of
    position 1's logits is p_s (log p_s - log p_t - KL) / 2 = (-0.274653, 0.274653) / 2."""
    eye = torch.nn.Linear(2, 2, bias=False, dtype=torch.float64)
    eye.weight.data = torch.eye(2, dtype=torch.float64)
    h_s = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]], dtype=torch.float64, requires_grad=True)
    h_t = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]], dtype=torch.float64)
    terms = hidden_terms(h_s, h_t, torch.tensor([0, 1]), Head(eye), Head(eye), beta=1.0, temperature=1.0)
    second = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # KL((3/4, 1/4) || (1/2, 1/2))
    # the logits are taken in fp32, as in training
    assert terms.divergence.tolist() == pytest.approx([REVERSE, second], abs=1e-6)
    assert terms.logprobs.tolist() == pytest.approx([math.log(0.5), math.log(0.25)], abs=1e-6)
    assert terms.entropy[0].item() == pytest.approx(math.log(2.0), abs=1e-6)
    (terms.divergence.sum() / 2).backward()
    g = 0.5 * (math.log(0.5 / 0.75) - REVERSE)
    assert h_s.grad[0].tolist() == pytest.approx([g / 2, -g / 2], abs=1e-6)


def test_temperature_divides_both_models_logits():
    eye = torch.nn.Linear(2, 2, bias=False, dtype=torch.float64)
    eye.weight.data = torch.eye(2, dtype=torch.float64)
    h_s, h_t = torch.tensor([[0.0, 0.0]], dtype=torch.float64), torch.tensor([[2 * math.log(3.0), 0.0]], dtype=torch.float64)
    terms = hidden_terms(h_s, h_t, torch.tensor([0]), Head(eye), Head(eye), beta=1.0, temperature=2.0)
    assert terms.divergence.item() == pytest.approx(REVERSE, abs=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_the_loss_and_gradients_are_trls_on_the_same_tensors(beta):
    """TRL's DistillationTrainer loss (_chunked_divergence_loss, its torch path on CPU): the same value and the
    same gradients for the student's hidden states and output layer, with a chunk smaller than the tokens."""
    distillation = pytest.importorskip("trl.trainer.distillation_trainer")
    torch.manual_seed(0)
    n, h, v = 12, 8, 40
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 2:] = False  # two padded positions
    h_s, h_t = torch.randn(3, 4, h) * 0.5, torch.randn(3, 4, h + 4) * 0.5  # the teacher is wider: only the vocabulary is shared
    w_s, w_t = torch.randn(v, h), torch.randn(v, h + 4)
    ours_h, ours_w = h_s.clone().requires_grad_(), w_s.clone().requires_grad_()
    head = torch.nn.Linear(h, v, bias=False)
    head.weight = torch.nn.Parameter(ours_w)
    teacher_head = torch.nn.Linear(h + 4, v, bias=False)
    teacher_head.weight.data = w_t
    ids = torch.randint(0, v, (3, 4))
    terms = hidden_terms(ours_h[mask], h_t[mask], ids[mask], Head(head), Head(teacher_head), beta, temperature=0.7, chunk=4)
    ours = terms.divergence.sum() / mask.sum()
    ours.backward()
    trl_h, trl_w = h_s.clone().requires_grad_(), w_s.clone().requires_grad_()
    theirs, _, count = distillation._chunked_divergence_loss(trl_h, h_t, trl_w, w_t, mask.long(), beta, temperature=0.7)
    theirs.backward()
    assert int(count) == n - 2
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(ours_h.grad, trl_h.grad, rtol=1e-4, atol=1e-7)
    assert torch.allclose(head.weight.grad, trl_w.grad, rtol=1e-4, atol=1e-7)


def _self_distillation(model, weight: float = 0.0, beta: float = 1.0, fast: bool = True) -> Distillation:
    from rlvr.logprobs import LogProbs

    return Distillation(Teacher(copy.deepcopy(model)), beta, weight, LogProbs(fast=fast, temperature=1.0))


def test_rlvrs_forward_and_the_models_own_give_the_same_terms_and_gradients():
    """The fast path (each group's prompt once, no padding) against the model's own padded forward, for the
    student and the teacher (another model), on completions of different lengths."""
    from rlvr.distill import distill_terms
    from rlvr.llama import LlamaRunner

    tokenizer = make_tokenizer()
    model = make_tiny_model(len(tokenizer))
    teacher = Teacher(make_tiny_model(len(tokenizer), seed=1))
    batch = _two_completions(tokenizer)
    batch.completion_mask[1, 2] = False  # the second completion one token shorter
    batch.loss_mask[1, 2] = False
    found, grads = [], []
    for runner in (LlamaRunner(model), None):
        teacher.runner = LlamaRunner(teacher.model) if runner is not None else None
        model.zero_grad()
        t = distill_terms(model, teacher, batch, 0.5, 0.8, runner=runner)
        t.divergence.sum().backward()
        found.append(t)
        grads.append([p.grad.clone() for p in model.parameters()])
    for name in ("divergence", "logprobs", "entropy"):
        assert torch.allclose(getattr(found[0], name), getattr(found[1], name), atol=1e-5), name
    assert found[0].divergence[1, 2] == 0 and (found[0].divergence[batch.loss_mask] > 0).all()
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*grads))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_a_teacher_that_is_the_student_gives_zero_loss_and_gradient(beta):
    tokenizer = make_tokenizer()
    model = make_tiny_model(len(tokenizer))
    batch = _two_completions(tokenizer)
    logp, entropy, loss, metrics = _self_distillation(model, beta=beta)(model, batch, LossNorm(2, 6.0, 3))
    loss.backward()
    assert abs(loss.item()) < 1e-6 and abs(metrics["divergence"].item()) < 1e-6
    assert max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None) < 1e-6
    assert (entropy[batch.loss_mask] > 0).all()


@pytest.mark.parametrize("fast", [True, False])
def test_the_mixed_objective_with_a_self_teacher_is_grpos_update(fast):
    """distill_reward_weight = 1 and a teacher equal to the student: the divergence and its gradient are 0,
    so the update's loss and gradients are GRPO's own on the same batch (its log-probs by rlvr's fast path,
    the distillation's by the model's own forward)."""
    tokenizer = make_tokenizer()
    model = make_tiny_model(len(tokenizer))
    batch = _two_completions(tokenizer)
    grpo = _policy_update(model)
    plain = grpo.accumulate_gradients(batch)
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    mixed = _policy_update(model)
    mixed.objective = _self_distillation(model, weight=1.0, fast=fast)
    sums = mixed.accumulate_gradients(batch)
    assert sums["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-7)
    assert abs(sums["divergence"]) < 1e-6 and "clip_ratio/low" in sums
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, expected[name], rtol=1e-4, atol=1e-6), name
    weighted = _policy_update(model)
    weighted.objective = _self_distillation(model, weight=0.25, fast=fast)
    assert weighted.accumulate_gradients(batch)["loss"] == pytest.approx(0.25 * plain["loss"], rel=1e-5, abs=1e-7)


# --- the settings ------------------------------------------------------------------------------

def _distill(**settings):
    from rlvr.methods import method_settings

    return build_config(method_settings("distill", {}), method_settings("distill", settings))


def test_distill_settings_and_their_rules(tmp_path):
    from rlvr.settings import check_settings

    cfg = _distill(teacher=str(tmp_path), beta=0.5)
    assert (cfg.method, cfg.teacher_model_name_or_path, cfg.distill_beta, cfg.beta, cfg.num_generations) == \
           ("distill", str(tmp_path), 0.5, 0.0, 1)
    with pytest.raises(ConfigError, match="needs a teacher"):
        check_settings(_distill())
    with pytest.raises(ConfigError, match=r"distill_beta\) must be in \[0, 1\]"):
        _distill(teacher="t", beta=1.5)
    with pytest.raises(ConfigError, match="set num_generations >= 2"):
        _distill(teacher="t", distill_reward_weight=0.5)
    _distill(teacher="t", distill_reward_weight=0.5, num_generations=4, per_device_train_batch_size=8)
    with pytest.raises(ConfigError, match="num_generations must be at least 2"):
        build_config({"num_generations": 1})  # GRPO compares a group
    with pytest.raises(ConfigError, match="are for rlvr distill"):
        build_config({"teacher_model_name_or_path": "t"})
    with pytest.raises(ConfigError, match="fsdp is not supported yet"):
        _distill(teacher="t", fsdp=True)
    with pytest.raises(ConfigError, match="shape GRPO's loss"):
        _distill(teacher="t", entropy_coef=0.1)


def test_a_missing_teacher_directory_is_named_before_any_model_loads(tmp_path, tiny_model_dir):
    from rlvr.settings import check_settings

    with pytest.raises(ConfigError, match="teacher model directory not found: ./no-such-teacher"):
        check_settings(_distill(model=str(tiny_model_dir), teacher="./no-such-teacher"))


def test_distillation_config_has_trls_fields_and_meaning(tmp_path):
    from rlvr import DistillationConfig

    args = DistillationConfig(output_dir=str(tmp_path / "out"), teacher_model_name_or_path="t", beta=0.0, temperature=0.9,
                              teacher_model_revision="main")
    assert args.beta == 0.0 and args._config.distill_beta == 0.0 and args._config.beta == 0.0
    assert args._config.teacher_model_init_kwargs == {"revision": "main"}
    assert DistillationConfig(output_dir=str(tmp_path)).beta == 1.0  # TRL's default: the reverse KL
    with pytest.raises(ConfigError, match="must be in"):
        DistillationConfig(output_dir=str(tmp_path), beta=2.0)


# --- whole runs on the tiny model --------------------------------------------------------------

def _copy_rows(numbers) -> list[dict]:
    """Prompts "copy 37" answered 37: a rule the tiny model learns in a few hundred steps (the verifier takes
    the final number: reward_args accuracy.final_number)."""
    return [{"prompt": f"copy {n}", "completion": str(n), "answer": str(n)} for n in numbers]


HELD_OUT = range(5, 100, 5)  # numbers no training prompt has
TRAIN_ROWS = _copy_rows([n for n in range(10, 100) if n not in HELD_OUT] * 2)
COMMON = dict(per_device_train_batch_size=16, max_completion_length=3, reward_args={"accuracy": {"final_number": True}}, logging_steps=1, save_steps=1000, report_steps=0,
              bf16=False, eval_on_start=False, eval_on_end=False)


@pytest.mark.trains
def test_a_teacher_that_is_the_student_trains_with_zero_divergence(tmp_path, tiny_model_dir):
    from rlvr.run import train

    cfg = _distill(model=str(tiny_model_dir), teacher=str(tiny_model_dir), task_args={"digits": 2, "num_train": 20, "num_test": 4},
                   max_steps=2, output_dir=str(tmp_path / "run"), **COMMON)
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(abs(r["divergence"]) < 1e-6 and r["grad_norm"] < 1e-5 for r in rows)


@pytest.mark.trains
def test_a_student_distilled_from_a_trained_teacher_gains_held_out_accuracy(tmp_path, tiny_model_dir):
    """A tiny teacher trained (SFTTrainer) to answer "copy 37" with 37, then a fresh tiny student distilled from
    it (DistillationTrainer, the teacher given by path, no reward) on the same prompts: the verifier's held-out
    accuracy, on numbers neither ever trained on, rises from none to most of the teacher's."""
    from rlvr import DistillationConfig, DistillationTrainer, SFTConfig, SFTTrainer

    test_rows = _copy_rows(HELD_OUT)
    sft = SFTTrainer(str(tiny_model_dir), args=SFTConfig(output_dir=str(tmp_path / "teacher"), max_steps=250, learning_rate=1e-2,
                                                         **COMMON), train_dataset=TRAIN_ROWS, eval_dataset=test_rows)
    sft.train()
    teacher = sft.evaluate()["eval_accuracy"]
    args = DistillationConfig(output_dir=str(tmp_path / "student"), max_steps=100, learning_rate=1e-2, **COMMON)
    student = DistillationTrainer(str(tiny_model_dir), teacher_model=str(tmp_path / "teacher"), args=args,
                                  train_dataset=[{"prompt": r["prompt"], "answer": r["answer"]} for r in TRAIN_ROWS],
                                  eval_dataset=test_rows)
    before = student.evaluate()["eval_accuracy"]
    student.train()
    after = student.evaluate()["eval_accuracy"]
    print(f"held-out accuracy: teacher {teacher:.2f}, student before {before:.2f}, after {after:.2f}")
    assert teacher >= 0.4, teacher
    assert before <= 0.1 and after >= 0.3, (before, after, teacher)


@pytest.mark.trains
def test_a_trl_distillation_yaml_trains_a_step_with_rlvr_distill(tiny_model_dir, tmp_path):
    """DistillationConfig's names as a TRL YAML writes them (beta picks the divergence), with the mixed objective."""
    import yaml

    from rlvr.cli import main

    recipe = tmp_path / "distill.yaml"
    recipe.write_text(f"teacher_model_name_or_path: {tiny_model_dir}\nbeta: 0.5\ntemperature: 0.9\nmax_completion_length: 6\n"
                      "distill_reward_weight: 0.5\nnum_generations: 4\nper_device_train_batch_size: 8\n")
    code = main(["distill", str(recipe), f"model={tiny_model_dir}", f"output_dir={tmp_path / 'run'}", "max_steps=1", "logging_steps=1",
                 "eval_on_start=false", "eval_on_end=false", "task_args.num_train=8", "task_args.num_test=2"])
    assert code == 0
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(row["divergence"]) < 1e-6 and "clip_ratio/low_mean" in row  # the teacher is the student; GRPO's term is in
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert (saved["method"], saved["distill_beta"], saved["beta"], saved["temperature"]) == ("distill", 0.5, 0.0, 0.9)


@pytest.mark.trains
def test_a_teacher_given_as_a_loaded_model_and_one_with_another_vocabulary(tmp_path, tiny_model_dir):
    from rlvr import DistillationConfig, DistillationTrainer
    from rlvr.errors import ModelError

    teacher = make_tiny_model(len(make_tokenizer()), seed=1)
    args = DistillationConfig(output_dir=str(tmp_path / "run"), max_steps=2, **COMMON)
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in TRAIN_ROWS[:16]]
    out = DistillationTrainer(str(tiny_model_dir), teacher_model=teacher, args=args, train_dataset=rows).train()
    assert out.global_step == 2 and out.metrics["train_loss"] > 0  # another model: a divergence to move
    args = DistillationConfig(output_dir=str(tmp_path / "gkd"), max_steps=2, lmbda=0.0, **COMMON)  # GKD: the dataset's completions only
    DistillationTrainer(str(tiny_model_dir), teacher_model=teacher, args=args, train_dataset=TRAIN_ROWS[:16]).train()
    logged = [json.loads(line) for line in (tmp_path / "gkd" / "metrics.jsonl").read_text().splitlines()]
    assert [r["distill/on_policy"] for r in logged] == [0.0, 0.0]
    other = make_tiny_model(len(make_tokenizer()) + 3, seed=1)
    args = DistillationConfig(output_dir=str(tmp_path / "other"), max_steps=1, **COMMON)
    with pytest.raises(ModelError, match="the same vocabulary"):
        DistillationTrainer(str(tiny_model_dir), teacher_model=other, args=args, train_dataset=rows).train()


@pytest.mark.trains
def test_lmbda_mixes_in_steps_on_the_datasets_completions_and_resumes_exactly(tmp_path, tiny_model_dir):
    """GKD's lmbda = 0.5: a seeded coin per step (on-policy when u <= lmbda, as TRL's GKD) picks the student's
    samples or the dataset's own completions ("37" and EOS: 3 tokens each); a run cut after its checkpoint at
    step 3 and resumed logs the same steps, to the bit."""
    import shutil

    from rlvr.run import train

    teacher = tmp_path / "teacher"
    make_tiny_model(len(make_tokenizer()), seed=1).save_pretrained(teacher)
    make_tokenizer().save_pretrained(teacher)
    data = tmp_path / "copy.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in TRAIN_ROWS))
    settings = {**COMMON, "save_steps": 3, "max_completion_length": 6}

    def config(**more):
        return _distill(model=str(tiny_model_dir), teacher=str(teacher), dataset=str(data), lmbda=0.5, max_steps=6,
                        output_dir=str(tmp_path / "run"), text_prompts="raw", **settings, **more)

    train(config())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    coin = torch.Generator().manual_seed(config().seed)
    expected = [0.0 if torch.rand((), generator=coin).item() > 0.5 else 1.0 for _ in range(6)]
    assert [r["distill/on_policy"] for r in rows] == expected and 0 < sum(expected) < 6
    assert all(r["completions/num_tokens"] == 16 * 3 for r, on in zip(rows, expected) if not on)
    assert all("reward" in r for r, on in zip(rows, expected) if on)
    shutil.rmtree(tmp_path / "run" / "checkpoint-6")
    train(config(resume=True))
    again = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    keys = ("loss", "divergence", "distill/on_policy", "grad_norm")
    assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in rows]


@pytest.mark.trains
def test_lmbda_without_a_completion_within_max_length_is_a_clear_error(tmp_path, tiny_model_dir, capsys):
    from rlvr.cli import main

    data = tmp_path / "copy.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in TRAIN_ROWS[:8]))
    code = main(["distill", f"model={tiny_model_dir}", f"teacher={tiny_model_dir}", f"dataset={data}", "lmbda=0.5", "max_length=4",
                 "max_steps=1", "per_device_train_batch_size=8", f"output_dir={tmp_path / 'run'}", "eval_on_start=false",
                 "eval_on_end=false"])
    assert code == 2
    assert "none of its 7 keeps a completion token within max_length=4" in capsys.readouterr().err  # 8 rows, 1 held out
