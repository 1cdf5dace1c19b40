"""Chat-template mutations for the untrusted-input fuzzer (tests/untrusted_fuzz.py): templates that loop
10^10 times, build a 10^9-character string, recurse through macros, write huge output, double a string
past memory, reach for Python's internals or do not parse. Each is rendered as LLM.chat renders a
caller's template, in the engine's TemplateSandbox with its default limits.
"""

from __future__ import annotations

import random
from pathlib import Path

from untrusted_mutation import Bases, Mutation

TEMPLATES = {
    "a loop of 10^10 steps": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "'x' * 10**9": "{{ 'x' * 10**9 }}",
    "recursion through a macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "10^9 characters of output": "{% for i in range(100000) %}{% for j in range(10000) %}x{% endfor %}{% endfor %}",
    "range(10**10) | list": "{{ range(10**10) | list | length }}",
    "a string doubled 64 times": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                                  "{% endfor %}{{ ns.s | length }}"),
    "the messages list * 10**9": "{{ (messages * 10**9) | length }}",
    "10 ** 10 ** 8": "{{ 10 ** 10 ** 8 }}",
    "Python's subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "a syntax error": "{% for %}",
    "raise_exception": "{{ raise_exception('the template refuses') }}",
    "an undefined filter": "{{ messages | nope }}",
}


def template_mutation(description: str, template: str) -> Mutation:
    def make(bases: Bases, folder: Path) -> str:
        path = folder / "template.jinja"
        path.write_text(template)
        return str(path)

    return Mutation("template", description, "template", make)


def catalog() -> list[Mutation]:
    return [template_mutation(description, template) for description, template in TEMPLATES.items()]


def drawn(rng: random.Random, bases: Bases) -> Mutation:
    """A hostile template of random size: nested loops, a repeated string, a recursion, a doubled string."""
    kind = rng.randrange(4)
    if kind == 0:
        outer, inner = 10 ** rng.randrange(3, 7), 10 ** rng.randrange(3, 7)
        return template_mutation(f"a loop of {outer} x {inner} writing 'ab'", "{% for i in range(" + str(outer)
                                 + ") %}{% for j in range(" + str(inner) + ") %}ab{% endfor %}{% endfor %}")
    if kind == 1:
        power = rng.randrange(5, 12)
        return template_mutation(f"'xy' * 10**{power}", "{{ 'xy' * 10**" + str(power) + " }}")
    if kind == 2:
        depth = rng.choice((100, 1000, 10**6))
        return template_mutation(f"a macro recursing to depth {depth}", "{% macro f(n) %}{% if n < " + str(depth)
                                 + " %}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}")
    times = rng.randrange(10, 70)
    return template_mutation(f"a string doubled {times} times", "{% set ns = namespace(s='x') %}{% for i in range("
                             + str(times) + ") %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}")
