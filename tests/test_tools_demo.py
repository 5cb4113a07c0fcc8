"""The calculator prompt of the tools demo: it renders, and the call it shows is a valid tool call."""

from rlvr.tasks.arithmetic import TEMPLATES, ArithmeticTask
from rlvr.tools import ToolBox, parse_tool_calls


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
