#!/usr/bin/env python3
"""chat_template_reference.py: chat templates rendered by Jinja itself, set up the way Hugging
Face transformers' apply_chat_template sets it up, to check strata's own renderer against.

    chat_template_reference.py render CASES.json OUT.json

CASES.json is a list of {"template": str, "context": object}. OUT.json gets one entry per case:
{"text": str, "generation": [[start, end], ...]} when it rendered (the UTF-8 byte ranges of the
text that {% generation %} blocks wrote, as transformers' return_assistant_tokens_mask finds
them), or {"error": str, "kind": ...} when it did not, where kind is
"raise_exception" (error is the template's own message) or "exception" (error is the exception's
type name and message, e.g. a syntax error or an undefined value used as a value).

The environment is transformers' (_compile_jinja_template), rebuilt here from its documented
behaviour: an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, loop controls,
{% generation %} blocks rendered as their body (TRL's assistant markers, recorded), raise_exception and
strftime_now as globals, and a tojson filter that is json.dumps with ensure_ascii=False instead
of Jinja's HTML-safe one. Contexts are passed as keyword arguments, as transformers passes
messages, tools, add_generation_prompt and the special tokens. JSON objects keep their key order
(Python's dicts do), which is what tojson and dict iteration print.

Needs Jinja (Debian's python3-jinja2); exit status 77 when it is missing.
"""
import datetime
import json
import sys

try:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox
except ImportError:
    print("the jinja2 module is missing: install Debian's python3-jinja2", file=sys.stderr)
    sys.exit(77)


class TemplateRaised(jinja2.exceptions.TemplateError):
    """What raise_exception throws, told apart from Jinja's own errors."""


def raise_exception(message):
    raise TemplateRaised(message)


def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


# Marks around each generation block's output, taken out after rendering: where they were is
# where the block's text landed (transformers records the same for its assistant masks).
# Private-use code points, which no conversation of the corpus holds.
OPEN, CLOSE = "\ue000", "\ue001"


def generation_spans(marked):
    """The text without the marks, and the UTF-8 byte ranges the marks enclosed."""
    text, spans, start = [], [], None
    at = 0  # bytes of text so far
    for ch in marked:
        if ch == OPEN:
            start = at
        elif ch == CLOSE:
            if start is not None and at > start:
                spans.append([start, at])
            start = None
        else:
            text.append(ch)
            at += len(ch.encode("utf-8"))
    return "".join(text), spans


class GenerationBlock(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: the body is rendered between marks (see
    generation_spans), so the text is the same and where each body landed is known."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body", [])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return OPEN + caller() + CLOSE


def environment():
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render_all(cases):
    env = environment()
    compiled = {}  # source -> Template or the exception parsing it raised
    out = []
    for case in cases:
        source = case["template"]
        try:
            if source not in compiled:
                compiled[source] = env.from_string(source)
            text, spans = generation_spans(compiled[source].render(**case["context"]))
            out.append({"text": text, "generation": spans})
        except TemplateRaised as e:
            out.append({"error": str(e.message), "kind": "raise_exception"})
        except Exception as e:  # noqa: BLE001 - every other failure is reported, not fatal
            where = getattr(e, "lineno", None)  # syntax errors know their line
            message = f"{type(e).__name__}: {e}" + (f" (line {where})" if where else "")
            out.append({"error": message, "kind": "exception"})
    return out


def main(argv):
    if len(argv) != 4 or argv[1] != "render":
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[2], encoding="utf-8") as f:
        cases = json.load(f)
    out = render_all(cases)
    with open(argv[3], "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
