"""How often does rlvr's verifier agree with a peer project's graded cases?

    git clone https://github.com/huggingface/Math-Verify /path/to/Math-Verify
    python benchmarks/peer_grading.py /path/to/Math-Verify [--boxed] [--keep cases.jsonl]

Reads the (gold, prediction, expected) cases of Math-Verify's own test suite from its test files
(with `ast`, nothing of it is imported or run), turns each into a `rlvr check-reward` case (the
gold as the reference, the prediction as the completion, the expected verdict as the label) and
prints agreement, precision and recall.  A prediction that holds no box is boxed when it is a
bare answer (no word of four letters or more), else kept as the free text it is; `--boxed`
boxes every prediction, free text too, as a user testing "every answer in \\boxed{}" would.

The labels are Math-Verify's, so they carry its policy (it reads answers out of free text, which
rlvr does only after an answer phrase) and a few of its mistakes (it grades 1 + 1/e equal to
1 - 1/e); read the disagreements, not only the rate.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import tempfile
from pathlib import Path

TEST_FILES = ["test_all.py", "test_numina_cases.py", "test_open_thoughts.py", "test_yujianll.py", "test_boxed.py",
              "test_string_extraction.py"]


def peer_cases(root: Path) -> list[dict]:
    cases = []
    for name in TEST_FILES:
        path = root / "tests" / name
        if not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            for decorator in node.decorator_list:
                cases += _parametrized(decorator, f"{name}:{node.name}")
    return cases


def _parametrized(decorator, source: str) -> list[dict]:
    if not (isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "parametrize"):
        return []
    try:
        names, rows = ast.literal_eval(decorator.args[0]), ast.literal_eval(decorator.args[1])
    except (ValueError, SyntaxError, IndexError):
        return []
    names = [n.strip() for n in (names.split(",") if isinstance(names, str) else names)]
    out = []
    for row in rows:
        values = dict(zip(names, row))
        expected = values.get("expected", values.get("result"))
        if "gold" in values and "pred" in values and expected in (0, 1):
            out.append({"answer": values["gold"], "prediction": values["pred"], "label": bool(expected), "source": source})
    return out


def as_completion(prediction: str, box_everything: bool) -> str:
    if "\\boxed" in prediction or "\\fbox" in prediction:
        return prediction
    bare = prediction.strip()
    words = re.sub(r"\\[A-Za-z]+|\\text\{[^{}]*\}", "", bare)
    if box_everything or (len(bare) < 200 and "\n" not in bare and not re.search(r"[A-Za-z]{4,}", words)):
        bare = re.sub(r"^\$+|\$+$", "", bare).strip()
        bare = re.sub(r"^\\[(\[]|\\[)\]]$", "", bare).strip()
        return f"The answer is $\\boxed{{{bare}}}$."
    return prediction


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("math_verify", type=Path, help="a clone of github.com/huggingface/Math-Verify")
    parser.add_argument("--boxed", action="store_true", help="box every prediction, free text too")
    parser.add_argument("--keep", type=Path, help="also write the cases to this JSONL file")
    args = parser.parse_args()
    cases = peer_cases(args.math_verify)
    if not cases:
        print(f"no graded cases found under {args.math_verify / 'tests'}", file=sys.stderr)
        return 2
    rows = [{"completion": as_completion(c["prediction"], args.boxed), "answer": c["answer"], "label": c["label"],
             "source": c["source"]} for c in cases]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if args.keep:
        args.keep.write_text(text)
    from rlvr.rewards.check import check_reward, format_result, load_cases

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cases.jsonl"
        path.write_text(text)
        result = check_reward(load_cases(path))
    print(format_result(result, f"Math-Verify's tests ({'every prediction boxed' if args.boxed else 'bare answers boxed'})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
