"""The calculator prompt of the tools demo: it renders, and the call it shows is a valid tool call."""

from rlvr.tasks.arithmetic import TEMPLATES, ArithmeticTask
from rlvr.tools import ToolBox, ToolCall, parse_tool_calls


def test_calculator_template_shows_a_call_the_toolbox_runs():
    train, test = ArithmeticTask.splits({"digits": 2, "operators": "*", "template": "calculator_example",
                                         "num_train": 5, "num_test": 5}, seed=0)
    prompt = test[0].prompt
    assert prompt.endswith(f"What is {test[0].columns['expression']}?")
    (call,) = parse_tool_calls(prompt)
    assert call.error is None and call.name == "calculator" and call.arguments == {"expression": "23 * 47"}
    assert ToolBox(["calculator"]).run(call) == ("1081", True)  # the result the example's \boxed{1081} shows
    assert "\\boxed{1081}" in prompt and "{expr}" in TEMPLATES["calculator_example"]


def test_calculator_call_template_spells_out_the_problems_own_call():
    _, test = ArithmeticTask.splits({"digits": 2, "operators": "*", "template": "calculator_call",
                                     "num_train": 5, "num_test": 5}, seed=0)
    (call,) = parse_tool_calls(test[0].prompt)
    assert call.arguments == {"expression": test[0].columns["expression"]}
    assert ToolBox(["calculator"]).run(call) == (test[0].answer, True)


def test_tools_demo_is_a_packaged_config():
    from rlvr.settings import resolve_config

    cfg = resolve_config(["tools_demo"])
    assert cfg.tools == ("calculator",) and cfg.task_args["template"] == "calculator_call"


def test_the_chain_environment_needs_two_dependent_calls_and_spells_out_the_next():
    """The two-call demo (configs/tools_chain_demo.yaml): the prompt spells out the first call, of the
    problem's first two numbers; the tool takes two numbers only, so one call cannot give the answer;
    each answer spells out the next call (on what the last one returned), a wrong call is answered with
    the call still due, and the last says the product is the answer."""
    from rlvr.environments import MethodEnvironment
    from rlvr.tasks.arithmetic import MultiplyChain

    _, test = ArithmeticTask.splits({"digits": 2, "operands": 3, "operators": "*", "template": "multiply_chain",
                                     "num_train": 5, "num_test": 5}, seed=0)
    example = test[0]
    a, b, c = (int(x) for x in example.columns["expression"].split(" * "))
    (first,) = parse_tool_calls(example.prompt)
    assert first.arguments == {"a": a, "b": b}
    env = MethodEnvironment(MultiplyChain(), ToolBox([]))
    assert env.reset(example) is None  # the row's own prompt
    (step,) = [env.step(example.prompt)]  # the model copies the spelled-out call
    (second,) = parse_tool_calls(step.observation)
    assert step.observation.startswith(f"{a * b}. Next, call it like this:") and second.arguments == {"a": a * b, "b": c}
    wrong = env.step('<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>').observation
    assert wrong.startswith("12. Next") and parse_tool_calls(wrong)[0].arguments == {"a": a * b, "b": c}  # still due
    last = env.step(f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a * b}, "b": {c}}}}}\n</tool_call>').observation
    assert last == f"{example.answer}. That is the product of all the numbers: write it as \\boxed{{}}."
    assert env.step(f"So the answer is \\boxed{{{example.answer}}}.").done  # no call: the rollout ends
    assert env.step('<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 5, "c": 7}}\n</tool_call>').observation \
        == "Error: multiply: got an unexpected keyword argument 'c'"  # two numbers a call


def test_the_chain_demo_is_a_packaged_config_and_its_template_wants_three_factors():
    import pytest

    from rlvr.settings import resolve_config

    cfg = resolve_config(["tools_chain_demo"])
    assert cfg.environment == "rlvr.tasks.arithmetic:MultiplyChain" and cfg.max_turns == 3
    with pytest.raises(ValueError, match="template multiply_chain is for three or more numbers multiplied"):
        ArithmeticTask.check_args({"operands": 2, "operators": "*", "template": "multiply_chain"})
