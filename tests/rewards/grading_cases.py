r"""Graded cases for the math verifier: (reference, completion, correct?), grouped by class.

Written for rlvr from the conventions of public graders (Math-Verify's extraction and
equivalence tests, lm-eval's MATH/Minerva answer normalisation, GSM8K's `#### N` format) and
from what models actually write.  Each class holds the near misses a policy could find next to
the true equivalents, so every rule is tested in both directions.  `rlvr check-reward` reads the
same cases from JSONL (tests/rewards/test_grading_suite.py writes them out).
"""

BOXED = [  # where the answer is read from
    ("42", r"so the total is $\boxed{42}$.", True),
    ("42", r"\fbox{42}", True),
    ("42", r"hence $\boxed 42$", True),
    (r"\frac{1}{2}", r"$\boxed{\frac{1}{2}}$", True),
    ("5", r"First \boxed{3}, then after checking the second case carefully we get \boxed{5}.", True),
    ("3", r"First \boxed{3}, then after checking the second case carefully we get \boxed{5}.", False),
    ("7", r"\boxed{7", False),  # never closed
    ("7", r"\boxed{}", False),
    ("7", r"The answer is 7 but I will not box it.", True),  # a stated answer
    ("7", r"\boxedx{7}", False),
    ("12", "<think>6 + 6 = 12</think>\n<answer>12</answer>", True),
    ("12", r"<answer>The sum is \boxed{12}.</answer>", True),
    ("12", "<answer>11</answer>", False),
    ("12", "<answer>   </answer>", False),
    ("9", r"\[ \boxed{9} \]", True),
    ("9", r"**Final Answer**" "\n" r"\[\boxed{9}\]", True),
]

NUMBERS = [
    ("1234", r"\boxed{1,234}", True),
    ("1234", r"\boxed{1{,}234}", True),
    ("10000", r"\boxed{10,\!000}", True),
    ("11111111100", r"\boxed{11,\! 111,\! 111,\! 100}", True),
    ("1234", r"\boxed{1 234}", True),
    ("32349", r"\boxed{32, 349}", False),  # a comma and a space separate a list
    ("12345", r"\boxed{12, 345}", False),
    ("1234", r"\boxed{1.234}", False),
    ("1.22", r"\boxed{1,22}", True),  # a decimal comma: not three digits after it
    ("0.111", r"\boxed{0,111}", True),
    ("1000000000", r"\boxed{1000000001}", False),  # integers compare exactly
    ("123456789012", r"\boxed{123456789013}", False),
    ("7", r"\boxed{6.9999999}", False),
    ("7", r"\boxed{7.0}", True),
    ("7", r"\boxed{7.00}", True),
    ("0.5", r"\boxed{0.5000001}", False),  # terminating decimals compare exactly
    ("0.5", r"\boxed{.5}", True),
    ("0.5", r"\boxed{\frac{1}{2}}", True),
    ("0.5", r"\boxed{\dfrac12}", True),
    ("0.5", r"\boxed{1/2}", True),
    (r"\frac{1}{3}", r"\boxed{0.3333333}", True),  # a decimal for a value that does not terminate
    (r"\frac{1}{3}", r"\boxed{0.333}", False),
    (r"\frac{1}{3}", r"\boxed{0.33}", False),
    (r"\frac{2}{3}", r"\boxed{0.6666667}", True),
    (r"\frac{1}{12}", r"\boxed{0.0833333333}", True),
    (r"\frac{3}{4}", r"\boxed{0.75}", True),
    (r"\frac{3}{4}", r"\boxed{\frac{6}{8}}", True),
    (r"-\frac{3}{4}", r"\boxed{\frac{-3}{4}}", True),
    (r"-\frac{3}{4}", r"\boxed{\frac{3}{4}}", False),
    ("-5", r"\boxed{-5}", True),
    ("-5", r"\boxed{5}", False),
    ("5", r"\boxed{+5}", True),
    ("5", r"\boxed{−5}", False),  # a Unicode minus is still a minus
    ("1500", r"\boxed{1.5e3}", True),
    ("1500", r"\boxed{1.5 \times 10^{3}}", True),
    ("0.025", r"\boxed{2.5\cdot10^{-2}}", True),
    ("1500", r"\boxed{1.5 \times 10^{4}}", False),
    ("50", r"\boxed{50\%}", True),
    ("0.5", r"\boxed{50\%}", True),
    ("28\\%", r"\boxed{28 percent}", True),
    ("5", r"\boxed{50\%}", False),
    ("16386.17", r"\boxed{\$16386.17}", True),  # a currency sign is decoration
    ("16386.17", r"\boxed{\$16,\!386.17}", True),
    ("16386.17", r"\boxed{\$16386.18}", False),
    ("12", r"\boxed{12.}", True),
    ("12", r"\boxed{1.2}", False),
    ("8", r"\boxed{18}", False),
    ("3", r"\boxed{x = 3}", True),
    ("x = 3", r"\boxed{3}", True),
    ("3", r"\boxed{x=4}", False),
    (r"\frac{1}{3}", r"\boxed{\left( \frac{1}{3} \right)}", True),
    ("0", r"\boxed{1e-7}", False),
    ("9", r"\boxed{" + "9" * 300 + "}", False),
]

UNITS = [
    (r"5\text{ m}", r"\boxed{5\text{ m}}", True),
    (r"5\text{ m}", r"\boxed{5\text{ cm}}", False),  # a unit in the reference must be matched
    (r"5\text{ m}", r"\boxed{5 \text{ meters}}", True),
    (r"5\text{ m}", r"\boxed{5}", True),  # a missing unit is no error
    ("5", r"\boxed{5\text{ apples}}", True),
    (r"15\mbox{ cm}^2", r"\boxed{15\mbox{ cm}^2}", True),
    (r"15\mbox{ cm}^2", r"\boxed{15 \text{ square centimeters}}", True),
    (r"15\mbox{ cm}^2", r"\boxed{15\text{ cm}}", False),
    (r"15\mbox{ cm}^2", r"\boxed{15\text{ m}^2}", False),
    ("125 miles", r"\boxed{125\textnormal{ miles}}", True),
    ("125 miles", r"\boxed{125\text{ km}}", False),
    (r"90^\circ", r"\boxed{90^{\circ}}", True),
    (r"90^\circ", r"\boxed{90°}", True),
    (r"90^\circ", r"\boxed{90 \text{ degrees}}", True),
    (r"90^\circ", r"\boxed{90}", True),
    (r"90^\circ", r"\boxed{45^\circ}", False),
    ("3 hours", r"\boxed{3\text{ hrs}}", True),
    ("3 hours", r"\boxed{3 \text{ minutes}}", False),
    (r"0.06 \text{ yuan}", r"\boxed{0.06 \text{ yuan}}", True),
    (r"2\sqrt{2}\text{ cm}", r"\boxed{\sqrt{8}\text{ cm}}", True),
    (r"2\sqrt{2}\text{ cm}", r"\boxed{\sqrt{8}\text{ m}}", False),
    ("18 dollars", r"\boxed{\$18}", True),
    ("18 dollars", r"\boxed{\$19}", False),
]

CONSTANTS = [  # e, i and pi are values, never units
    (r"1+\mathrm{i}", r"\boxed{1}", False),
    (r"1+\mathrm{i}", r"\boxed{1+i}", True),
    (r"1+\mathrm{i}", r"\boxed{i+1}", True),
    (r"2\mathrm{i}", r"\boxed{2}", False),
    (r"2\mathrm{i}", r"\boxed{2i}", True),
    (r"1-\frac{1}{\mathrm{e}}", r"\boxed{1+\frac{1}{\mathrm{e}}}", False),
    (r"1-\frac{1}{\mathrm{e}}", r"\boxed{1-e^{-1}}", True),
    (r"\frac{1}{\mathrm{e}}", r"\boxed{e^{-1}}", True),
    (r"\frac12\mathrm{e}^{2}", r"\boxed{\frac12}", False),
    (r"\frac12\mathrm{e}^{2}", r"\boxed{\frac{e^2}{2}}", True),
    (r"2\pi", r"\boxed{2}", False),
    (r"2\pi", r"\boxed{2\pi}", True),
    (r"\frac{9}{4}\pi", r"\boxed{\frac94\pi}", True),
    (r"\frac{\pi}{2}", r"\boxed{\frac{\pi}{3}}", False),
    (r"\text{e}", r"\boxed{e}", True),
]

LISTS = [
    ("(2, 2), (6, 2)", r"\boxed{(2, 2)} and \boxed{(6, 2)}", True),  # the final answer's boxes together
    ("(2, 2), (6, 2)", r"\boxed{(6, 2)} \quad \text{and} \quad \boxed{(2, 2)}", True),
    ("(2, 2), (6, 2)", r"\boxed{(2, 2)}", False),  # half of the answer
    ("(2, 2), (6, 2)", r"\boxed{(2, 2), (6, 2), (1, 1)}", False),
    ("1, 2, 3", r"\boxed{1}, \boxed{2}, \boxed{3}", True),
    ("1, 2, 3", r"\boxed{1} and \boxed{2} and \boxed{3}", True),
    (r"\{1, 2, 3\}", r"\boxed{3, 2, 1}", True),
    ("-2, 1", r"The integer roots are \boxed{-2} and \boxed{1}.", True),
    ("-2, 1", r"\boxed{1, -2}", True),
    ("-2, 1", r"\boxed{-2, 1, 2}", False),
    ("k = 45, n = 2", r"\boxed{k = 45} \quad \text{and} \quad \boxed{n = 2}", True),
    ("(3, 3), (1, 1)", r"\boxed{(3, 3)} \text{ for part (a) and } \boxed{(1, 1)}", True),
    ("7", r"\boxed{7} or \boxed{8}", False),  # hedging is a list, and a list is not 7
    ("7", r"\boxed{8} or \boxed{7}", False),
    ("7", r"\boxed{8}, or maybe \boxed{7}", False),
    ("7", r"\boxed{7 \text{ or } 8}", False),
    ("7", r"\boxed{7, 8}", False),
    ("7", r"\boxed{7} \quad \boxed{7}", True),  # the same answer twice is one answer
    ("7", r"I first thought \boxed{8}, but I made an error in the second step; redoing it gives \boxed{7}.", True),
    ("21, 16, 11", r"\boxed{21, 16 \text{ or } 11}", True),
    ("19, 46, 82", r"\boxed{19, 46, \text{ and } 82}", True),
    ("(11,7) or (7,11)", r"\boxed{(7,11),\ (11,7)}", True),
    ("6 \\text{ and } 8", r"\boxed{6,8}", True),
    (r"1 \pm \sqrt{19}", r"\boxed{1 \pm \sqrt{19}}", True),
    (r"\pm 2021", r"\boxed{2021}", False),
    (r"\pm 2021", r"\boxed{-2021, 2021}", True),
]

TEXT = [
    ("odd", r"\boxed{\text{odd}}", True),
    (r"\text{odd}", r"\boxed{odd}", True),
    (r"\text{Even}", r"\boxed{even}", True),
    (r"\text{odd}", r"\boxed{\text{even}}", False),
    (r"\text{Evelyn}", r"Therefore, $\boxed{\text{Evelyn}}$ is our answer.", True),
    (r"\text{Evelyn}", r"\boxed{\text{Carla}}", False),
    ("(C)", r"\boxed{\text{(C)}}", True),
    (r"\text{C}", r"\boxed{\text{(C)}}", True),
    ("(C)", r"\boxed{B}", False),
    ("Yes", r"\boxed{\text{yes}}", True),
    ("Yes", r"\boxed{\text{no}}", False),
]

SYMBOLIC = [
    (r"\sqrt{8}", r"\boxed{2\sqrt{2}}", True),
    (r"\sqrt{8}", r"\boxed{2\sqrt{3}}", False),
    (r"3\sqrt{13}", r"\boxed{\sqrt{117}}", True),
    (r"\sqrt{2}+\sqrt{5}", r"\boxed{\sqrt 2+\sqrt 5}", True),
    ("(x+1)^2", r"\boxed{x^2+2x+1}", True),
    ("(x+1)^2", r"\boxed{x^2+1}", False),
    (r"\frac{x+2}{7}", r"\boxed{\frac{x}{7}+\frac{2}{7}}", True),
    (r"2 \sin b \cos a", r"\boxed{2 \cos a \sin b}", True),
    (r"\tan^2(y)+1", r"\boxed{\sec^2(y)}", True),
    ("(0,1]", r"\boxed{(0, 1]}", True),
    ("(0,1]", r"\boxed{[0, 1]}", False),
    ("(0,9)", r"\boxed{[0,9)}", False),
    (r"(-\infty, -3] \cup [2, \infty)", r"\boxed{(-\infty,-3]\cup[2,\infty)}", True),
    (r"(-\infty, -3] \cup [2, \infty)", r"\boxed{[-3, 2]}", False),
    (r"[-1, -\frac{1}{2}) \cup (-\frac{1}{2}, 0)", r"\boxed{[-1, -\tfrac12) \cup (-\tfrac12, 0)}", True),
    (r"\{-1\} \cup [0,7)", r"\boxed{\{-1\} \cup [0,7)}", True),
    ("(3, \\frac{\\pi}{2})", r"\boxed{\left( 3, \frac{\pi}{2} \right)}", True),
    ("(3, \\frac{\\pi}{2})", r"\boxed{\left( \frac{\pi}{2}, 3 \right)}", False),
    ("(6,31,-1)", r"\boxed{(6,31,-1)}", True),
    ("(1, \\frac{9}{2})", r"\boxed{(1, 4.5)}", True),
    (r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", r"\boxed{\begin{pmatrix}1 & 2\\ 3 & 4\end{pmatrix}}", True),
    (r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", r"\boxed{\begin{pmatrix}1&2\\3&5\end{pmatrix}}", False),
    (r"\begin{pmatrix}1\\0\end{pmatrix}", r"\boxed{\begin{bmatrix}1\\0\end{bmatrix}}", True),
    ("x \\geq 5", r"\boxed{x \ge 5}", True),
    ("x \\geq 5", r"\boxed{5 \leq x}", True),
    ("x \\geq 5", r"\boxed{x \leq 5}", False),
    ("x < 1", r"\boxed{-x > -1}", True),
    ("x < 1", r"\boxed{x > -1}", False),
    ("[-2, 7]", r"\boxed{-2 \le x \le 7}", True),
    ("y = 2x + 3", r"\boxed{y = 3 + 2x}", True),
    ("y = 2x + 3", r"\boxed{y = 2x - 3}", False),
    ("2x+4y-3=0", r"\boxed{y=-\frac{1}{2}x+\frac{3}{4}}", True),
    (r"\frac{\pi r}{h+r}", r"\boxed{\frac{\pi r}{r+h}}", True),
    (r"\binom{5}{2}", r"\boxed{10}", True),
    (r"f(2) < f(1) < f(4)", r"\boxed{f(2) < f(1) < f(4)}", True),
    (r"\frac{1}{2}\sqrt{3}", r"\boxed{\frac{\sqrt{3}}{2}}", True),
    (r"x = \frac{70}{9}", r"\boxed{x = \frac{70}{9} \approx 7.78}", True),  # the exact value of a chain
]

STATED = [
    ("12", "The answer is 12.", True),
    ("12", "The answer is 13.", False),
    ("12", "So the answer is $12$.", True),
    ("(1,2)", r"Final Answer: The final answer is $(1, 2)$. I hope it is correct.", True),
    (r"\frac{1}{2}", r"Final Answer: The final answer is $\frac{1}{2}$. I hope it is correct.", True),
    ("(0,1)", r"the domain is $[0, 1)$. Final Answer: The final answer is $[0, 1)$. I hope it is correct.", False),
    ("28\\%", r"Final Answer: The final answer is $28 \%$. I hope it is correct.", True),
    ("34", "Final Answer: The largest $n$ is 34.", True),
    ("120", r"Final Answer: The volume of $ABCDEFGH$ is 120. I hope it is correct.", True),
    ("10455", r"... so the interest is $\boxed{255}$ ... Final Answer: The final answer is $10,455$. I hope it is correct.", True),
    ("255", r"... so the interest is $\boxed{255}$ ... Final Answer: The final answer is $10,455$. I hope it is correct.", False),
    ("72", "Natalia sold 48 + 24 = 72 clips.\n#### 72", True),
    ("72", "Natalia sold 48 + 24 = 72 clips.\n#### 71", False),
    ("1234", "#### 1,234", True),
    ("0.5", "**Final answer:** \\frac{1}{2}", True),
    ("8", "I think 7 is close, but the answer is 8", True),
    ("7", "I think 7 is close, but the answer is 8", False),
    ("12", "12 apples. The answer is 12 apples.", True),
]

HOSTILE = [  # what a reward-hacking policy might try; none of it may pass
    ("1", r"\boxed{1+\foo{2}}", False),  # math-verify would drop the unknown command
    ("5", r"\boxed{\le 5}", False),  # and read a dangling relation as its operand
    ("3", r"\boxed{3 +}", False),
    ("0", r"\boxed{0.\overline{3}}", False),
    ("204", r"\boxed{204_5}", False),  # a number in base 5
    ("3", r"\boxed{\div 3}", False),
    ("8", r"\boxed{3 + 5}", True),  # the expression's value is the answer (numeric_accuracy refuses it)
    ("5", r"\boxed{5xy}", False),
    ("5", r"\boxed{5 ab}", False),
    ("1", r"\boxed{1, 2, \ldots}", False),
    ("42", r"\boxed{42} " + "a" * 100_000, False),  # only the last 20,000 characters are read
    ("42", "a" * 100_000 + r" \boxed{42}", True),
    ("7", "\x00\\boxed{7}\x00", True),
    ("10^{10^{10}}", r"\boxed{10^{10^{10}}}", True),  # equal strings: no symbolic step needed
]

FINAL_NUMBER = [  # with final_number=true: the last number, only when it stands whole
    ("42", "She has 42 apples in all.", True),
    ("42", "6 x 7 = 42", True),
    ("-5", "So x = -5.", True),
    ("1234", "The total is 1,234.", True),
    ("42", "The total is **42**.", True),
    ("2", r"so $x = \frac{1+\sqrt{5}}{2}$", False),  # a fragment of a fraction
    ("2", "AZYUK2A", False),  # a digit inside a word
    ("5", r"hence $x \geq 5$", False),  # after an inequality
    ("9", "the interval is [0,9)", False),
    ("5", "3 - 5", False),
    ("234", "1, 234", False),
    ("2", "10^2", False),
    ("7", "The answer is 7. Then 8.", True),  # a stated answer wins over the last number
]

_JANET = "Janet's ducks lay 16 eggs a day; she eats 3, bakes with 4 and sells the rest at $2 each.\n16 - 3 - 4 = 9\n9 * 2 = 18\n#### 18"
GSM8K = [  # model solutions against GSM8K references (`#### N`), the formats small models write
    (_JANET, "She has 16 - 3 - 4 = 9 eggs left and sells them for 9 * 2 = $18.\n#### 18", True),
    (_JANET, "16 - 3 - 4 = 9 eggs, 9 x $2 = $18. The answer is $18.", True),
    (_JANET, "16 - 3 - 4 = 9, and 9 * 2 = 18, so she makes \\boxed{18} dollars.", True),
    (_JANET, "She makes $\\boxed{\\$18}$ every day.", True),
    (_JANET, "\\boxed{18 \\text{ dollars}}", True),
    (_JANET, "**Answer: $18**", True),
    (_JANET, "Final answer: 18.00", True),
    (_JANET, "The answer is: 18 dollars per day.", True),
    (_JANET, "9 eggs remain, so the answer is 18.", True),
    (_JANET, "She sells 9 eggs, so she makes \\boxed{9}.", False),
    (_JANET, "16 - 3 - 4 = 9\n#### 9", False),
    (_JANET, "The answer is $16.", False),
    (_JANET, "The answer is 18.5.", False),
    (_JANET, "She makes money at the market every day.", False),
    (_JANET, "\\boxed{18} or \\boxed{9}", False),
    ("A robe takes 2 bolts of blue fiber and half that much white fiber.\n2 + 1 = 3\n#### 3", "2 + 2/2 = 3 bolts\n#### 3", True),
    ("2 + 1 = 3\n#### 3", "It takes \\boxed{3} bolts in total.", True),
    ("2 + 1 = 3\n#### 3", "It takes 3 bolts.\n#### 3 bolts", True),
    ("2 + 1 = 3\n#### 3", "\\boxed{2.5}", False),
    ("The profit is 70,000 dollars.\n#### 70,000", "The profit is $70,000.\n#### 70000", True),
    ("#### 70000", "So the profit is \\boxed{70,000}.", True),
    ("#### 70000", "So the profit is \\boxed{70.000}.", False),
    ("#### 70000", "The answer is 70 000.", True),
    ("#### 540", "3 sprints x 3 times x 60 m = 540 m\n#### 540", True),
    ("#### 540", "He runs \\boxed{540 \\text{ meters}} a week.", True),
    ("#### 540", "He runs \\boxed{540 \\text{ km}} a week.", True),  # the reference has no unit to match
    ("#### 540", "He runs \\boxed{180} meters each sprint.", False),
    ("#### 20", "Each chicken gets 3 cups a meal, 20 chickens... The final answer is 20.", True),
    ("#### 20", "The final answer is 20%.", True),  # a percentage p also matches p
    ("#### 20", "The final answer is 2.", False),
    ("#### 64", "Kylar pays 8 * 5 + 8 * 3 = $64 for the glasses.\n\nThe answer is 64", True),
    ("#### 64", "Kylar pays $64.00.\n#### 64.00", True),
    ("#### 64", "Kylar pays 8 * 5 = 40 ... #### 40", False),
    ("#### 260", "Toulouse has 2 * 20 = 40 ... total 20 + 40 + 160 = 260 sheep. \\boxed{260}", True),
    ("#### 260", "total 20 + 40 + 160 = 260 sheep. \\boxed{260.5}", False),
    ("#### 160", "The answer is \\boxed{160}.</answer>", True),
    ("#### 160", "<think>4 * 40 = 160</think><answer>160</answer>", True),
    ("#### 160", "<think>4 * 40 = 160</think><answer>16</answer>", False),
]

CLASSES = {
    "boxed": BOXED, "numbers": NUMBERS, "units": UNITS, "constants": CONSTANTS, "lists": LISTS,
    "text": TEXT, "symbolic": SYMBOLIC, "stated": STATED, "hostile": HOSTILE, "gsm8k": GSM8K,
}


def all_cases() -> list[tuple[str, str, str, bool]]:
    """(class, reference, completion, correct) for every default-extraction case."""
    return [(name, ref, completion, label) for name, cases in CLASSES.items() for ref, completion, label in cases]
