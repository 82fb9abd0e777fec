"""The `multi` grader: named graders combined by a formula, `calculate_output`.

The formula has numbers, the graders' names (each stands for that grader's reward), the
operators `+ - * / ^` (`^` is power), parentheses, and the functions min, max, abs, floor,
ceil, exp, sqrt and log. It is parsed with `ast` into a tree that may hold only those nodes
and evaluated by walking it: it is never given to eval(), so `__import__('os')` or
`x.__class__` is a validation error, not code. Every number is a float, so `9 ^ 9 ^ 9`
overflows instead of building a huge integer.

A formula that cannot be computed for a sample (division by zero, log of a negative, an
overflow) scores 0 with `formula_parse_error`. The parts' rewards are the response's
`sub_rewards`; their error flags are ORed into the multi grader's.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
from typing import Any, ClassVar

from kiln.graders.base import Fields, Grader, Judge, as_grader, parse
from kiln.graders.result import GradeResult

FUNCTIONS = {"min": (min, 1, None), "max": (max, 1, None), "abs": (abs, 1, 1), "floor": (math.floor, 1, 1),
             "ceil": (math.ceil, 1, 1), "exp": (math.exp, 1, 1), "sqrt": (math.sqrt, 1, 1), "log": (math.log, 1, 2)}
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.Pow: operator.pow}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
PART_TYPES = ("string_check", "text_similarity", "python", "score_model", "label_model")


class FormulaError(ValueError):
    pass


def compile_formula(text: str, names: set[str]) -> ast.expr:
    """The checked tree of a formula; FormulaError says what is wrong with it, naming any
    unknown function or grader first."""
    try:
        tree = ast.parse(text.replace("^", "**"), mode="eval").body
    except SyntaxError as exc:
        raise FormulaError(f"is not a formula: {exc.msg}") from None
    except (RecursionError, MemoryError):
        raise FormulaError("is nested too deeply") from None
    except ValueError as exc:  # null bytes, huge literals
        raise FormulaError(f"is not a formula: {exc}") from None
    nodes = list(ast.walk(tree))
    callees = {id(n.func) for n in nodes if isinstance(n, ast.Call)}
    unknown_functions, unknown_names, problems = set(), set(), []
    for node in nodes:
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.keywords:
                problems.append("may call only min, max, abs, floor, ceil, exp, sqrt and log, by name")
            elif node.func.id not in FUNCTIONS:
                unknown_functions.add(node.func.id)
            else:
                _, least, most = FUNCTIONS[node.func.id]
                if len(node.args) < least or (most is not None and len(node.args) > most):
                    problems.append(f"calls {node.func.id} with {len(node.args)} argument(s)")
        elif isinstance(node, ast.Name):
            if id(node) not in callees and node.id not in names:
                unknown_names.add(node.id)
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                problems.append(f"may hold only numbers, not {node.value!r}")
        elif isinstance(node, ast.BinOp | ast.UnaryOp):
            if type(node.op) not in BINARY and type(node.op) not in UNARY:
                problems.append("may use only the operators + - * / ^")
        elif not isinstance(node, ast.Load | ast.operator | ast.unaryop):
            problems.append(f"may not contain {type(node).__name__} expressions")
    if unknown_functions:
        raise FormulaError(f"calls unknown function(s) {', '.join(sorted(unknown_functions))}; "
                           f"the functions are {', '.join(FUNCTIONS)}")
    if unknown_names:
        raise FormulaError(f"references unknown grader(s) {', '.join(sorted(unknown_names))}; "
                           f"the graders are {', '.join(sorted(names)) or 'none'}")
    if problems:
        raise FormulaError(problems[0])
    return tree


def evaluate(node: ast.expr, values: dict[str, float]) -> float:
    """Walks a tree from compile_formula; math errors propagate (ZeroDivisionError, ...)."""
    if isinstance(node, ast.Constant):
        return float(node.value)
    if isinstance(node, ast.Name):
        return float(values[node.id])
    if isinstance(node, ast.BinOp):
        return float(BINARY[type(node.op)](evaluate(node.left, values), evaluate(node.right, values)))
    if isinstance(node, ast.UnaryOp):
        return UNARY[type(node.op)](evaluate(node.operand, values))
    if isinstance(node, ast.Call):
        return float(FUNCTIONS[node.func.id][0](*(evaluate(a, values) for a in node.args)))
    raise FormulaError(f"unexpected {type(node).__name__}")


@dataclasses.dataclass(kw_only=True)
class MultiGrader(Grader):
    type: ClassVar[str] = "multi"
    graders: dict[str, Grader]
    calculate_output: str
    formula: ast.expr = dataclasses.field(metadata={"json": False}, repr=False, compare=False)

    @classmethod
    def from_json(cls, f: Fields) -> MultiGrader:
        parts = f.get("graders")
        if isinstance(parts, dict) and isinstance(parts.get("type"), str):
            parts = {parts.get("name") or "grader": parts}  # one grader, as the client's types spell it
        if not isinstance(parts, dict) or not parts:
            raise f.bad("graders", "must be an object of named graders")
        graders = {}
        for key, data in parts.items():
            param = f"{f.at('graders')}.{key}"
            if isinstance(data, dict) and "name" not in data:
                data = {**data, "name": key}
            graders[key] = parse(data, param, allowed=PART_TYPES)
        text = f.text("calculate_output")
        try:
            formula = compile_formula(text, set(graders))
        except FormulaError as exc:
            raise f.bad("calculate_output", str(exc)) from None
        return cls(name=f.text("name"), graders=graders, calculate_output=text, formula=formula)

    @classmethod
    def of(cls, name: str, graders: dict[str, Any], calculate_output: str) -> MultiGrader:
        """A multi grader for Python callers: the parts may be grader JSON, Graders or plain
        `(sample, item) -> float` callables. FormulaError if the formula is bad."""
        parts = {key: as_grader(g, f"graders.{key}") for key, g in graders.items()}
        return cls(name=name, graders=parts, calculate_output=calculate_output,
                   formula=compile_formula(calculate_output, set(parts)))

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out["graders"] = {k: g.to_json() for k, g in self.graders.items()}
        return out

    def judge_models(self) -> set[str]:
        return set().union(*(g.judge_models() for g in self.graders.values()))

    def _grade(self, sample: dict, item: Any, judge: Judge | None) -> GradeResult:
        parts = {key: g.grade(sample, item, judge) for key, g in self.graders.items()}
        rewards = {key: r.reward for key, r in parts.items()}
        try:
            reward = evaluate(self.formula, rewards)
            if not math.isfinite(reward):
                raise OverflowError(f"the formula gave {reward}")
            result = GradeResult(reward)
        except (ArithmeticError, ValueError):
            result = GradeResult.failed(formula_parse_error=True)
        result.sub_rewards = rewards
        result.scores = dict(rewards)
        usage: dict[str, dict[str, int]] = {}
        for r in parts.values():
            result.errors.merge(r.errors)
            for model, counts in r.token_usage_per_model.items():
                mine = usage.setdefault(model, dict.fromkeys(counts, 0))
                for k, v in counts.items():
                    mine[k] = mine.get(k, 0) + v
            if r.token_usage is not None:
                result.token_usage = (result.token_usage or 0) + r.token_usage
            result.sampled_model_name = result.sampled_model_name or r.sampled_model_name
        result.token_usage_per_model = usage
        return result
