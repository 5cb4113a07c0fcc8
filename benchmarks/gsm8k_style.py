"""A deterministic generator of grade-school math word problems in GSM8K's format.

    python benchmarks/gsm8k_style.py [--out DIR] [--train 400] [--test 100] [--seed 0]

It writes DIR/train.jsonl and DIR/test.jsonl (default DIR: tests/data/gsm8k_style), one
{"question": ..., "answer": ...} object a line.  The answer is a worked solution as GSM8K
writes it: two to four short sentences, each computation carrying a calculator annotation
(``She has 12 - 5 = <<12-5=7>>7 apples left.``), and a last line ``#### N`` with the final
integer.  The problems come from a fixed set of hand-written templates (shopping and change,
ages, rates and time, sharing, savings, percentages, multi-step totals), filled in with
varied names, objects and numbers; every result is a positive integer below 1000 and every
division is exact.  No question appears twice, in a file or across the two files.

This is the GSM8K-format file behind docs/finetune.md's SFT/GRPO/DPO comparison table and the
tests: small, committed, and reproducible.  The same arguments give byte-identical files
(standard library only, a seeded random.Random).  Every row is checked by `check_row`
(each annotation's arithmetic recomputed by a small integer parser, and ``#### N`` equal to
the last annotation) before anything is written.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "data" / "gsm8k_style"
LIMIT = 1000  # every annotated result is a positive integer below this


# ---------------------------------------------------------------------------------------------
# Checking a row: a tiny parser for integer arithmetic (+ - * / and parentheses), no eval.
# ---------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(\d+)|([-+*/()]))")
_ANNOTATION = re.compile(r"<<([^<>]*)>>")
_FINAL = re.compile(r"#### (0|[1-9]\d*)")


def _tokens(expr: str) -> list[str]:
    out, at = [], 0
    expr = expr.rstrip()
    while at < len(expr):
        match = _TOKEN.match(expr, at)
        if match is None:
            raise ValueError(f"unexpected character in expression {expr!r} at position {at}")
        out.append(match.group(1) or match.group(2))
        at = match.end()
    if not out:
        raise ValueError("empty expression")
    return out


class _Parser:
    """expr := term (('+' | '-') term)*; term := factor (('*' | '/') factor)*;
    factor := integer | '(' expr ')'.  Every value, partial ones included, must be a
    non-negative integer, and every division exact."""

    def __init__(self, expr: str):
        self.expr, self.items, self.at = expr, _tokens(expr), 0

    def peek(self) -> str | None:
        return self.items[self.at] if self.at < len(self.items) else None

    def take(self) -> str:
        item = self.peek()
        if item is None:
            raise ValueError(f"expression {self.expr!r} ends too early")
        self.at += 1
        return item

    def parse(self) -> int:
        value = self.sum()
        if self.peek() is not None:
            raise ValueError(f"unexpected {self.peek()!r} in expression {self.expr!r}")
        return value

    def sum(self) -> int:
        value = self.product()
        while self.peek() in ("+", "-"):
            op, right = self.take(), self.product()
            value = value + right if op == "+" else value - right
            if value < 0:
                raise ValueError(f"negative partial result in {self.expr!r}")
        return value

    def product(self) -> int:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op, right = self.take(), self.factor()
            if op == "*":
                value *= right
            elif right == 0 or value % right:
                raise ValueError(f"division {value}/{right} in {self.expr!r} is not exact")
            else:
                value //= right
        return value

    def factor(self) -> int:
        item = self.take()
        if item == "(":
            value = self.sum()
            if self.take() != ")":
                raise ValueError(f"unbalanced parentheses in {self.expr!r}")
            return value
        if not item.isdigit():
            raise ValueError(f"expected a number in {self.expr!r}, got {item!r}")
        return int(item)


def evaluate(expr: str) -> int:
    """The value of an integer expression with + - * / and parentheses; ValueError otherwise."""
    return _Parser(expr).parse()


def check_row(row) -> None:
    """Raise ValueError unless `row` is a well-formed GSM8K-format row whose arithmetic is right.

    Checked: exactly the keys question and answer, both non-empty strings; the answer is 2-4
    sentence lines then ``#### N`` (N an integer, no commas); every line holds at least one
    ``<<expr=value>>`` annotation, followed by the value itself and preceded by the same
    expression written out (``12 - 5 = <<12-5=7>>7``); every expression evaluates exactly to its
    value, a positive integer below 1000; and N equals the last annotation's value."""
    if not isinstance(row, dict) or set(row) != {"question", "answer"}:
        raise ValueError(f"a row must be a dict with exactly the keys question and answer, got {row!r}")
    question, answer = row["question"], row["answer"]
    if not isinstance(question, str) or not question.strip() or "\n" in question:
        raise ValueError(f"question must be a non-empty single-line string, got {question!r}")
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError(f"answer must be a non-empty string, got {answer!r}")
    lines = answer.split("\n")
    final = _FINAL.fullmatch(lines[-1])
    if final is None:
        raise ValueError(f"the answer's last line must be '#### N' with N an integer, got {lines[-1]!r}")
    body = lines[:-1]
    if not 2 <= len(body) <= 4:
        raise ValueError(f"the answer must have 2-4 solution lines before '#### N', got {len(body)}")
    last = None
    for line in body:
        if line.count("<<") != line.count(">>"):
            raise ValueError(f"unbalanced annotation markers in {line!r}")
        found = list(_ANNOTATION.finditer(line))
        if not found:
            raise ValueError(f"solution line without a calculator annotation: {line!r}")
        for match in found:
            expr, eq, shown = match.group(1).partition("=")
            if not eq or "=" in shown or not re.fullmatch(r"[1-9]\d*", shown):
                raise ValueError(f"annotation must read <<expression=integer>>, got {match.group()!r}")
            value = int(shown)
            if evaluate(expr) != value:
                raise ValueError(f"wrong arithmetic: {expr} is {evaluate(expr)}, not {value}, in {line!r}")
            if not 0 < value < LIMIT:
                raise ValueError(f"result {value} is not a positive integer below {LIMIT}: {line!r}")
            after = line[match.end():]
            if not re.match(rf"{value}(?!\d)", after):
                raise ValueError(f"annotation {match.group()!r} must be followed by its value: {line!r}")
            written = line[:match.start()].rstrip().rstrip("$").rstrip()
            if not written.endswith("="):
                raise ValueError(f"annotation {match.group()!r} must follow the written expression and '=': {line!r}")
            compact = written[:-1].replace(" ", "")
            if not compact.endswith(expr) or compact[:-len(expr)][-1:].isdigit():
                raise ValueError(f"the written expression before {match.group()!r} differs from it: {line!r}")
            last = value
    if int(final.group(1)) != last:
        raise ValueError(f"'#### {final.group(1)}' differs from the last annotation's value {last}")


# ---------------------------------------------------------------------------------------------
# Building blocks of the templates.
# ---------------------------------------------------------------------------------------------


class Retry(Exception):
    """The drawn numbers break a rule (a result out of range, an inexact division): draw again."""


def calc(expr: str, value: int, money: bool = False) -> str:
    """``expr = <<expr=value>>value`` (``$`` before the annotation for money), GSM8K's calculator
    notation; Retry when the value is not a positive integer below LIMIT."""
    if not 0 < value < LIMIT:
        raise Retry
    return f"{expr} = {'$' if money else ''}<<{expr.replace(' ', '')}={value}>>{value}"


def div(a: int, b: int) -> int:
    """a / b when it is exact; Retry otherwise."""
    if b <= 0 or a % b:
        raise Retry
    return a // b


def solution(lines: list[str], result: int) -> str:
    return "\n".join(lines + [f"#### {result}"])


class Person:
    def __init__(self, name: str, female: bool):
        self.name = name
        self.he, self.him, self.his = ("she", "her", "her") if female else ("he", "him", "his")
        self.He, self.His = self.he.capitalize(), self.his.capitalize()


FEMALE = ["Maria", "Aisha", "Priya", "Sofia", "Hannah", "Mei", "Fatima", "Grace", "Olivia", "Zoe", "Leila", "Rosa",
          "Nadia", "Emma", "Chloe", "Yuki", "Amara", "Ingrid", "Lucia", "Tanya", "Beatriz", "Keisha", "Anya", "Ruth"]
MALE = ["James", "Omar", "Diego", "Liam", "Ravi", "Kenji", "Mateo", "Noah", "Samuel", "Tariq", "Lucas", "Ethan",
        "Kwame", "Felix", "Arjun", "Hugo", "Malik", "Owen", "Tomas", "Ben", "Andre", "Jonah", "Pavel", "Marcus"]


def person(rng: random.Random, *avoid: Person) -> Person:
    taken = {p.name for p in avoid}
    while True:
        female = rng.random() < 0.5
        name = rng.choice(FEMALE if female else MALE)
        if name not in taken:
            return Person(name, female)


TEMPLATES: list[tuple[str, int, Callable[[random.Random], dict]]] = []  # (name, steps, function)


def template(steps: int):
    def register(fn):
        TEMPLATES.append((fn.__name__, steps, fn))
        return fn
    return register


def row(question: str, lines: list[str], result: int) -> dict:
    return {"question": question, "answer": solution(lines, result)}


# ---------------------------------------------------------------------------------------------
# Two-step templates.
# ---------------------------------------------------------------------------------------------

SHOP_ITEMS = [  # (singular, plural, lowest price, highest price)
    ("notebook", "notebooks", 2, 6), ("sandwich", "sandwiches", 4, 9), ("movie ticket", "movie tickets", 7, 14),
    ("pack of markers", "packs of markers", 3, 8), ("toy car", "toy cars", 2, 7), ("bag of rice", "bags of rice", 3, 9),
    ("paperback book", "paperback books", 5, 12), ("flower pot", "flower pots", 3, 10), ("scarf", "scarves", 8, 15),
    ("jar of honey", "jars of honey", 4, 11), ("pair of socks", "pairs of socks", 2, 6), ("puzzle", "puzzles", 6, 13),
]


@template(2)
def change_from_bill(rng):
    p = person(rng)
    _, items, low, high = rng.choice(SHOP_ITEMS)
    n, price = rng.randint(2, 9), rng.randint(low, high)
    cost = n * price
    bills = [b for b in (20, 50, 100) if b > cost]
    if not bills:
        raise Retry
    bill = rng.choice(bills)
    where = rng.choice(["at the market", "at a yard sale", "at the mall", "online", "at a corner shop"])
    question = (f"{p.name} buys {n} {items} {where} for ${price} each. {p.He} pays with a ${bill} bill. "
                f"How much change does {p.he} get back?")
    lines = [f"The {items} cost {calc(f'{n} * {price}', cost, True)} in total.",
             f"{p.name} gets {calc(f'{bill} - {cost}', bill - cost, True)} in change."]
    return row(question, lines, bill - cost)


RELATIVES = [  # (relative, pronoun, times as old: lowest, highest, and the least and most years between them)
    ("mother", "she", 3, 5, 20, 45), ("father", "he", 3, 5, 20, 48), ("aunt", "she", 3, 5, 18, 50),
    ("uncle", "he", 3, 5, 18, 50), ("grandmother", "she", 6, 9, 40, 80), ("grandfather", "he", 6, 9, 40, 80),
    ("older cousin", "the cousin", 2, 2, 3, 12),
]


@template(2)
def relative_age(rng):
    p = person(rng)
    relative, pronoun, low, high, least, most = rng.choice(RELATIVES)
    k, age, years = rng.randint(low, high), rng.randint(4, 12), rng.randint(2, 12)
    now = k * age
    if not least <= now - age <= most:
        raise Retry
    times = {2: "twice", 3: "three times", 4: "four times"}.get(k, f"{k} times")
    question = (f"{p.name} is {age} years old. {p.His} {relative} is {times} as old as {p.him}. "
                f"How old will {p.his} {relative} be in {years} years?")
    lines = [f"{p.name}'s {relative} is {calc(f'{k} * {age}', now)} years old now.",
             f"In {years} years, {pronoun} will be {calc(f'{now} + {years}', now + years)} years old."]
    return row(question, lines, now + years)


TREATS = ["cookies", "cupcakes", "muffins", "brownies", "granola bars", "lemon bars", "cinnamon rolls"]
SHARERS = [("friend", "friends"), ("classmate", "classmates"), ("teammate", "teammates"), ("neighbor", "neighbors"),
           ("cousin", "cousins")]


@template(2)
def share_after_keeping(rng):
    p = person(rng)
    treats, (one, many) = rng.choice(TREATS), rng.choice(SHARERS)
    people, each, kept = rng.randint(3, 9), rng.randint(2, 8), rng.randint(2, 12)
    total = people * each + kept
    occasion = rng.choice(["for a bake sale", "on Saturday", "for a school party", "for a picnic", "after school"])
    question = (f"{p.name} baked {total} {treats} {occasion}. {p.He} kept {kept} of them for {p.his} family and "
                f"shared the rest equally among {people} {many}. How many {treats} did each {one} get?")
    lines = [f"{p.name} shared {calc(f'{total} - {kept}', total - kept)} {treats}.",
             f"Each {one} got {calc(f'{total - kept} / {people}', div(total - kept, people))} {treats}."]
    return row(question, lines, each)


MACHINES = [  # (the rate, with {rate}; the job, with {name}, {n} and {per}; the unit; the verb)
    ("A printer prints {rate} pages per minute.", "{name} needs to print {n} copies of a {per}-page report.", "pages",
     "print"),
    ("A bottling machine fills {rate} bottles per minute.", "{name} has an order for {n} crates that hold {per} bottles "
     "each.", "bottles", "fill"),
    ("A baker can decorate {rate} cupcakes per minute.", "{name} ordered {n} boxes of {per} cupcakes for a wedding.",
     "cupcakes", "decorate"),
    ("A volunteer can fold {rate} flyers per minute.", "{name} needs {n} stacks of {per} folded flyers for the fair.",
     "flyers", "fold"),
    ("A cook can wrap {rate} dumplings per minute.", "{name} wants {n} trays with {per} dumplings on each tray.",
     "dumplings", "wrap"),
]


@template(2)
def machine_time(rng):
    p = person(rng)
    setup, need, unit, verb = rng.choice(MACHINES)
    n, per = rng.randint(2, 12), rng.randint(4, 20)
    total = n * per
    rates = [r for r in range(2, 16) if total % r == 0 and total // r > 1]
    if not rates:
        raise Retry
    rate = rng.choice(rates)
    question = (f"{setup.format(rate=rate)} {need.format(name=p.name, n=n, per=per)} "
                f"How many minutes will it take to {verb} all the {unit}?")
    lines = [f"There are {calc(f'{n} * {per}', total)} {unit} in all.",
             f"It will take {calc(f'{total} / {rate}', total // rate)} minutes."]
    return row(question, lines, total // rate)


SALE_ITEMS = ["jacket", "bicycle", "lamp", "pair of boots", "backpack", "guitar", "tennis racket", "coffee maker",
              "board game", "desk chair", "winter coat", "tent"]
STORES = ["a department store", "the mall", "an online shop", "a local shop", "the outlet store", "a discount store"]
PERCENTS = [10, 15, 20, 25, 30, 40, 50, 60, 75]


@template(2)
def sale_price(rng):
    item, store, pct = rng.choice(SALE_ITEMS), rng.choice(STORES), rng.choice(PERCENTS)
    step = 100 // _gcd(pct, 100)  # the price must be a multiple of this for an exact discount
    price = step * rng.randint(max(1, 20 // step), 400 // step)
    discount = price * pct // 100
    question = (f"A {item} at {store} normally costs ${price}. This week it is on sale for {pct}% off. "
                f"What is the sale price of the {item}?")
    lines = [f"The discount is {calc(f'{price} * {pct} / 100', discount, True)}.",
             f"The sale price is {calc(f'{price} - {discount}', price - discount, True)}."]
    return row(question, lines, price - discount)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


# ---------------------------------------------------------------------------------------------
# Three-step templates.
# ---------------------------------------------------------------------------------------------

PAIRS = [  # two things bought together: (plural, low, high) each
    (("notebooks", 2, 5), ("pens", 1, 3)), (("apples", 1, 2), ("loaves of bread", 3, 5)),
    (("T-shirts", 6, 12), ("caps", 4, 9)), (("comic books", 3, 6), ("sheets of stickers", 1, 2)),
    (("candles", 2, 6), ("greeting cards", 2, 4)), (("bags of chips", 1, 3), ("bottles of juice", 2, 4)),
    (("tulip bulbs", 1, 3), ("bags of soil", 4, 8)), (("tennis balls", 2, 4), ("water bottles", 5, 9)),
]


@template(3)
def two_items_change(rng):
    p = person(rng)
    (items1, lo1, hi1), (items2, lo2, hi2) = rng.choice(PAIRS)
    a, x, b, y = rng.randint(2, 8), rng.randint(lo1, hi1), rng.randint(2, 8), rng.randint(lo2, hi2)
    cost1, cost2 = a * x, b * y
    bills = [bill for bill in (20, 50, 100) if bill > cost1 + cost2]
    if not bills:
        raise Retry
    bill = rng.choice(bills)
    question = (f"{p.name} buys {a} {items1} for ${x} each and {b} {items2} for ${y} each. "
                f"{p.He} pays with a ${bill} bill. How much change should {p.he} receive?")
    lines = [f"The {items1} cost {calc(f'{a} * {x}', cost1, True)}.",
             f"The {items2} cost {calc(f'{b} * {y}', cost2, True)}.",
             f"{p.name} receives {calc(f'{bill} - {cost1} - {cost2}', bill - cost1 - cost2, True)} in change."]
    return row(question, lines, bill - cost1 - cost2)


@template(3)
def three_ages(rng):
    a = person(rng)
    b = person(rng, a)
    c = person(rng, a, b)
    part, word = rng.choice([(2, "half"), (3, "a third")])
    young, gap = rng.randint(4, 30), rng.randint(2, 25)
    old = young + gap
    third = div(old, part)
    question = (f"{a.name} is {gap} years older than {b.name}. {c.name} is {word} as old as {a.name}. "
                f"If {b.name} is {young} years old, what is the sum of their three ages?")
    lines = [f"{a.name} is {calc(f'{young} + {gap}', old)} years old.",
             f"{c.name} is {calc(f'{old} / {part}', third)} years old.",
             f"Together they are {calc(f'{young} + {old} + {third}', young + old + third)} years old."]
    return row(question, lines, young + old + third)


HABITS = [  # (verb phrase, the verb in a question, the verb after "on weekdays she", unit, weekday and weekend ranges)
    ("reads", "read", "reads", "pages", (8, 30), (15, 50)), ("jogs", "jog", "jogs", "miles", (2, 6), (3, 10)),
    ("practices the piano for", "practice", "practices for", "minutes", (15, 45), (20, 60)),
    ("swims", "swim", "swims", "laps", (10, 30), (12, 40)),
    ("writes", "write", "writes", "lines of code", (20, 60), (10, 30)),
    ("walks", "walk", "walks", "kilometers", (2, 8), (4, 12)),
]


@template(3)
def weekly_habit(rng):
    p = person(rng)
    verb, base, does, unit, (lo1, hi1), (lo2, hi2) = rng.choice(HABITS)
    weekday, weekend, weeks = rng.randint(lo1, hi1), rng.randint(lo2, hi2), rng.randint(2, 6)
    week1, week2 = 5 * weekday, 2 * weekend
    total = (week1 + week2) * weeks
    question = (f"{p.name} {verb} {weekday} {unit} every weekday and {weekend} {unit} on each day of the weekend. "
                f"How many {unit} does {p.he} {base} in {weeks} weeks?")
    lines = [f"On weekdays {p.he} {does} {calc(f'5 * {weekday}', week1)} {unit} a week.",
             f"On weekends {p.he} {does} {calc(f'2 * {weekend}', week2)} {unit} a week.",
             f"In {weeks} weeks {p.he} {does} {calc(f'({week1} + {week2}) * {weeks}', total)} {unit}."]
    return row(question, lines, total)


GOALS = ["a new bike", "a video game console", "a telescope", "a pair of running shoes", "a guitar", "a skateboard",
         "a camera", "a tablet", "a keyboard"]
JOBS = ["walking dogs", "mowing lawns", "babysitting", "washing cars", "selling lemonade", "tutoring"]
GIVERS = ["grandmother", "grandfather", "aunt", "uncle", "mom", "dad"]


@template(3)
def savings_weeks(rng):
    p = person(rng)
    goal, job, giver = rng.choice(GOALS), rng.choice(JOBS), rng.choice(GIVERS)
    saved, weekly, weeks = rng.randint(5, 60), rng.randint(5, 25), rng.randint(2, 12)
    gift = 2 * saved
    price = saved + gift + weekly * weeks
    question = (f"{p.name} is saving for {goal} that costs ${price}. {p.He} has already saved ${saved}, and {p.his} "
                f"{giver} gives {p.him} twice that amount. If {p.he} earns ${weekly} a week {job}, how many weeks "
                f"will it take {p.him} to save the rest?")
    rest = price - saved - gift
    lines = [f"{p.His} {giver} gives {p.him} {calc(f'2 * {saved}', gift, True)}.",
             f"{p.name} still needs {calc(f'{price} - {saved} - {gift}', rest, True)}.",
             f"It will take {p.him} {calc(f'{rest} / {weekly}', div(rest, weekly))} weeks."]
    return row(question, lines, weeks)


HARVESTS = [("apples", "bags"), ("oranges", "crates"), ("peaches", "baskets"), ("eggs", "cartons"),
            ("potatoes", "sacks"), ("plums", "boxes"), ("lemons", "bags")]


@template(3)
def pack_and_sell(rng):
    p = person(rng)
    things, packs = rng.choice(HARVESTS)
    size, count, kept, price = rng.randint(4, 12), rng.randint(3, 20), rng.randint(3, 20), rng.randint(2, 9)
    total = size * count + kept
    verb = "collected" if things == "eggs" else "picked"
    question = (f"{p.name} {verb} {total} {things} this morning. {p.He} kept {kept} for {p.his} family and packed "
                f"the rest into {packs} of {size}. If {p.he} sells each of the {packs} for ${price}, how much money "
                f"does {p.he} make?")
    lines = [f"{p.name} packed {calc(f'{total} - {kept}', total - kept)} {things}.",
             f"That fills {calc(f'{total - kept} / {size}', div(total - kept, size))} {packs}.",
             f"{p.He} makes {calc(f'{count} * {price}', count * price, True)}."]
    return row(question, lines, count * price)


VEHICLES = [("train", (40, 90)), ("bus", (30, 60)), ("truck", (35, 65)), ("car", (30, 70)),
            ("cyclist", (8, 20)), ("ferry", (10, 25))]


@template(3)
def two_leg_trip(rng):
    vehicle, (lo, hi) = rng.choice(VEHICLES)
    fast, slow = rng.randint(lo, hi), rng.randint(lo, hi)
    if fast == slow:
        raise Retry
    h1, h2 = rng.randint(2, 6), rng.randint(1, 5)
    d1, d2 = fast * h1, slow * h2
    change = "speeds up" if slow > fast else "slows down"
    question = (f"A {vehicle} travels at {fast} miles per hour for {h1} hours. Then it {change} to {slow} miles "
                f"per hour for the next {h2} hours. How many miles does the {vehicle} travel in all?")
    lines = [f"First it travels {calc(f'{fast} * {h1}', d1)} miles.",
             f"Then it travels {calc(f'{slow} * {h2}', d2)} miles.",
             f"In all it travels {calc(f'{d1} + {d2}', d1 + d2)} miles."]
    return row(question, lines, d1 + d2)


CROPS = [("tomato plants", "tomatoes"), ("pepper plants", "peppers"), ("bean plants", "bean pods"),
         ("strawberry plants", "strawberries"), ("cucumber vines", "cucumbers"), ("zucchini plants", "zucchinis")]


@template(3)
def garden_rows(rng):
    p = person(rng)
    plants, produce = rng.choice(CROPS)
    rows, per_row, each = rng.randint(2, 8), rng.randint(3, 10), rng.randint(2, 12)
    count = rows * per_row
    grown = count * each
    given = rng.randint(3, max(4, grown // 2))
    question = (f"{p.name} planted {rows} rows of {plants} with {per_row} in each row. Each one gave {each} "
                f"{produce}. {p.He} gave {given} {produce} to {p.his} neighbors. How many {produce} does {p.he} "
                f"have left?")
    lines = [f"{p.name} planted {calc(f'{rows} * {per_row}', count)} {plants}.",
             f"They gave {calc(f'{count} * {each}', grown)} {produce}.",
             f"{p.He} has {calc(f'{grown} - {given}', grown - given)} {produce} left."]
    return row(question, lines, grown - given)


STOCKS = [("bookstore", "books"), ("toy shop", "puzzles"), ("bakery", "loaves"), ("shoe store", "pairs of shoes"),
          ("garden center", "seed packets"), ("music shop", "guitar strings"), ("florist", "roses")]


@template(3)
def stock_over_days(rng):
    store, things = rng.choice(STOCKS)
    factor, word = rng.choice([(2, "twice"), (3, "three times")])
    monday, delivery = rng.randint(5, 40), rng.randint(10, 150)
    tuesday = factor * monday
    start = monday + tuesday + rng.randint(5, 300)
    left = start - monday - tuesday
    question = (f"A {store} had {start} {things} in stock. On Monday it sold {monday} {things}, and on Tuesday "
                f"it sold {word} as many as on Monday. On Wednesday a delivery brought {delivery} more {things}. "
                f"How many {things} does the {store} have now?")
    lines = [f"On Tuesday it sold {calc(f'{factor} * {monday}', tuesday)} {things}.",
             f"After two days it had {calc(f'{start} - {monday} - {tuesday}', left)} {things}.",
             f"After the delivery it has {calc(f'{left} + {delivery}', left + delivery)} {things}."]
    return row(question, lines, left + delivery)


# ---------------------------------------------------------------------------------------------
# Four-step templates.
# ---------------------------------------------------------------------------------------------

PARTY_FOODS = [  # (what is bought, what is eaten, plural of what is bought, the pieces, sizes)
    ("pizza", "pizza", "pizzas", "slices", (8, 10, 12)), ("sushi platter", "sushi", "sushi platters", "pieces", (12, 16, 20)),
    ("cake", "cake", "cakes", "pieces", (8, 10, 12)), ("pie", "pie", "pies", "slices", (6, 8)),
    ("tray of lasagna", "lasagna", "trays", "portions", (6, 9, 12)),
]


@template(4)
def party_food(rng):
    p = person(rng)
    food, eats, foods, pieces, sizes = rng.choice(PARTY_FOODS)
    size = rng.choice(sizes)
    guests, each, price = rng.randint(6, 30), rng.randint(2, 4), rng.randint(8, 20)
    eaten = guests * each
    count = div(eaten, size)
    cost = count * price
    coupon = rng.randint(2, max(3, cost // 4))
    question = (f"{p.name} is having a party for {guests} guests, and each guest will eat {each} {pieces} of "
                f"{eats}. Each {food} has {size} {pieces} and costs ${price}. {p.He} has a coupon for ${coupon} "
                f"off the whole order. How much will {p.he} pay?")
    lines = [f"The guests will eat {calc(f'{guests} * {each}', eaten)} {pieces}.",
             f"{p.name} needs {calc(f'{eaten} / {size}', count)} {foods}.",
             f"They cost {calc(f'{count} * {price}', cost, True)}.",
             f"With the coupon {p.he} pays {calc(f'{cost} - {coupon}', cost - coupon, True)}."]
    return row(question, lines, cost - coupon)


WORKPLACES = ["the library", "a cafe", "the animal shelter", "a bike shop", "the grocery store", "a bakery",
              "the swimming pool"]


@template(4)
def weekly_pay(rng):
    p = person(rng)
    place = rng.choice(WORKPLACES)
    part, word = rng.choice([(2, "half"), (3, "a third"), (4, "a quarter")])
    wage, hours, days, bonus = rng.randint(8, 18), rng.randint(2, 6), rng.randint(2, 5), rng.randint(5, 60)
    weekly_hours = hours * days
    earned = weekly_hours * wage
    total = earned + bonus
    saved = div(total, part)
    question = (f"{p.name} earns ${wage} an hour working at {place}. {p.He} works {hours} hours a day, {days} days "
                f"a week. This week {p.he} also got a ${bonus} bonus. If {p.he} saves {word} of everything {p.he} "
                f"earned this week, how much does {p.he} save?")
    lines = [f"{p.name} works {calc(f'{hours} * {days}', weekly_hours)} hours a week.",
             f"{p.He} earns {calc(f'{weekly_hours} * {wage}', earned, True)} for those hours.",
             f"With the bonus {p.he} earned {calc(f'{earned} + {bonus}', total, True)}.",
             f"{p.He} saves {calc(f'{total} / {part}', saved, True)}."]
    return row(question, lines, saved)


GROUPS = [  # (group, its people, what some of the boys do, "do" or "did", most people)
    ("a school club", "members", "take the bus home", "do", 60), ("a summer camp", "campers", "signed up for swimming",
                                                                  "did", 200),
    ("the fourth grade", "students", "walk to school", "do", 120),
    ("a chess tournament", "players", "brought their own boards", "did", 120),
    ("a choir", "singers", "also play an instrument", "do", 80), ("a hiking group", "hikers", "carry a map", "do", 50),
]


@template(4)
def percent_then_fraction(rng):
    group, people, activity, do, most = rng.choice(GROUPS)
    pct = rng.choice([10, 20, 25, 30, 40, 50, 60, 70, 75, 80])
    part, word = rng.choice([(2, "Half"), (3, "A third"), (4, "A quarter"), (5, "A fifth")])
    step = 100 // _gcd(pct, 100)
    total = step * rng.randint(max(1, 10 // step), most // step)
    girls = total * pct // 100
    boys = total - girls
    some = div(boys, part)
    question = (f"There are {total} {people} in {group}. {pct}% of them are girls and the rest are boys. "
                f"{word} of the boys {activity}. How many boys {do} not?")
    lines = [f"There are {calc(f'{total} * {pct} / 100', girls)} girls.",
             f"So there are {calc(f'{total} - {girls}', boys)} boys.",
             f"Of them, {calc(f'{boys} / {part}', some)} boys {activity}.",
             f"That leaves {calc(f'{boys} - {some}', boys - some)} boys who {do} not."]
    return row(question, lines, boys - some)


# ---------------------------------------------------------------------------------------------
# The files.
# ---------------------------------------------------------------------------------------------


def generate(n_train: int, n_test: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """n_train + n_test rows with distinct questions, the templates taken in turn (each round of
    them shuffled), so train and test share no question.  The same seed gives the same rows."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    queue: list = []
    while len(rows) < n_train + n_test:
        if not queue:
            queue = list(TEMPLATES)
            rng.shuffle(queue)
        name, _, make = queue.pop()
        for _ in range(10_000):
            try:
                candidate = make(rng)
            except Retry:
                continue
            if candidate["question"] not in seen:
                break
        else:
            raise RuntimeError(f"template {name} could not produce a new question")
        seen.add(candidate["question"])
        rows.append(candidate)
    return rows[:n_train], rows[n_train:]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    for r in rows:
        check_row(r)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps({"question": r["question"], "answer": r["answer"]}, ensure_ascii=False) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for train.jsonl and test.jsonl")
    parser.add_argument("--train", type=int, default=400, help="rows in train.jsonl")
    parser.add_argument("--test", type=int, default=100, help="rows in test.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.train < 0 or args.test < 0:
        parser.error("--train and --test must be non-negative")
    train, test = generate(args.train, args.test, args.seed)
    for name, rows in (("train", train), ("test", test)):
        write_jsonl(args.out / f"{name}.jsonl", rows)
        print(f"{args.out / f'{name}.jsonl'}: {len(rows)} rows")


if __name__ == "__main__":
    main()
