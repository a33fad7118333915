"""The built-in calculator tool: `rollout.env=rlhf.rl.environments.calculator:Calculator`.

A model turn calls it by writing `calc: EXPRESSION` (the last such call of the turn is evaluated); the
observation is the value (`4821+3907` -> `8728`), or `error: ...` for anything that is not arithmetic. A
turn without a call ends the episode (that turn is the answer). The syntax uses only characters the
embedded default's tokenizer has (letters, digits, space, `:`, `+`, `-`, `.`), so its tiny model can
learn it; `*`, `/` and parentheses work with tokenizers that have them.

The expression is parsed with `ast` and evaluated by walking the tree: numbers (integers, decimals) and
`+ - * /` (binary, and unary `+ -`) only; a name, a call, an attribute, a power, a string, anything else
is refused with an error observation, never evaluated (no eval). Exact rational arithmetic (Fraction):
an integer result prints as an integer, anything else as a decimal (at most 10 places, trailing zeros cut).
"""
from __future__ import annotations

import ast
import re
from fractions import Fraction

from rlhf.rl.environments.base import Environment, Step

CALL = "calc:"  # a call: `calc:` then the expression, to the end of its line
MAX_CHARS = 200        # longer expressions are refused
MAX_DIGITS = 40        # operands and results beyond this many digits are refused (no huge powers of work)


class CalcError(ValueError):
    """The expression is not one the calculator evaluates (the message is the observation)."""


_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: _div(a, b)}
_UNARY = {ast.UAdd: lambda a: a, ast.USub: lambda a: -a}


def _div(a: Fraction, b: Fraction) -> Fraction:
    if b == 0:
        raise CalcError("division by zero")
    return a / b


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value)
        return _bounded(value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _bounded(_BINARY[type(node.op)](_eval(node.left), _eval(node.right)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise CalcError(f"not arithmetic: {type(node).__name__} (only numbers and + - * /)")


def _bounded(x: Fraction) -> Fraction:
    if len(str(abs(x.numerator))) > MAX_DIGITS or len(str(x.denominator)) > MAX_DIGITS:
        raise CalcError(f"number too large (more than {MAX_DIGITS} digits)")
    return x


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression as text; CalcError (its message says why) for anything else."""
    text = expression.strip().rstrip(".").strip()
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    if not re.fullmatch(r"[0-9+\-*/. ()]+", text):  # before parsing: no names, strings or other operators
        raise CalcError("only digits, '.', spaces, parentheses and + - * / are allowed")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalcError("not a well-formed expression") from None
    return format_number(_eval(tree))


def format_number(x: Fraction) -> str:
    if x.denominator == 1:
        return str(x.numerator)
    out = f"{float(x):.10f}".rstrip("0").rstrip(".")
    return "0" if out in ("-0", "") else out


class Calculator(Environment):
    """One episode: each turn with `calc: EXPR` gets EXPR's value (or `error: ...`) as its observation; a
    turn without a call ends the episode. No reward parts (the answer is scored by reward.sources);
    info: the call, and tool_error=1 for a refused one."""

    def reset(self, row):
        return None

    def step(self, text: str) -> Step:
        if CALL not in text:
            return Step(None)
        call = text[text.rindex(CALL) + len(CALL):].split("\n")[0].strip()  # the last call, to the line's end
        try:
            return Step(evaluate(call), info={"call": call})
        except CalcError as e:
            return Step(f"error: {e}", info={"call": call, "tool_error": 1})
