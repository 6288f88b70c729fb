"""Tool calling and structured output for ``/v1/chat/completions``: prompts, guides, parsers.

How a request with ``tools`` runs:
1. ``tool_plan``: ``tool_choice`` -> a mode. ``none``: tools are not shown. ``auto``: the model
   writes free text, parsed afterwards. A named function: the output is constrained (a grammar,
   ``SamplingParams.guide``) to that tool's ``parameters`` schema — the text *is* the arguments.
   ``required``: the output is constrained to a JSON array of ``{"name", "arguments"}`` calls,
   each matching its tool's schema (one call when ``parallel_tool_calls`` is false).
2. ``render_messages``: the tools go through the model's chat template when it reads a ``tools``
   variable; otherwise into a system-prompt block in the parser family's format (the documented
   default: Hermes ``<tool_call>`` JSON). History turns with assistant ``tool_calls`` and ``tool``
   messages are rendered the same way.
3. ``ChoiceTools`` turns one choice's text deltas into content and OpenAI ``tool_calls`` (id and
   name first, then argument fragments), streamed or collected alike. In ``auto`` the family's
   parser (``PARSERS``) finds the calls; text that is no valid call stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .errors import bad_param

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")   # what OpenAI accepts as a function's name

# ---- parsers, one per model family ----------------------------------------------------------


@dataclass
class ToolCall:
    name: str
    arguments: str                     # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolTurns:
    """A conversation's tool calls and their outputs, in order, as OpenAI checks them: an output
    answers an open call of its id (a later turn may use an id again: some backends number calls
    per turn), each call once, and no call is left without one."""

    def __init__(self):
        self.open: list[str] = []      # calls without an output yet, in the order they were made
        self.made: set[str] = set()

    def call(self, cid: str) -> None:
        self.open.append(cid)
        self.made.add(cid)

    def answer(self, cid: str) -> str | None:
        """Take an output for ``cid``; what is wrong with it, or None."""
        if cid not in self.made:
            return f"no tool call found for the output with call id {str(cid)[:64]!r}"
        if cid not in self.open:
            return f"the tool call {str(cid)[:64]!r} has an output already: each call is answered once"
        self.open.remove(cid)
        return None

    def missing(self) -> str | None:
        """A call left without an output (the first), or None."""
        return self.open[0] if self.open else None


def _call_from(obj: Any, args_keys=("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesParser:
    """Hermes / Qwen 2.5+ / SmolLM (the default format): ``<tool_call>{"name", "arguments"}</tool_call>``."""
    name = "hermes"
    start = "<tool_call>"              # where a call begins (streaming holds text back from here)
    opens_reply = False                # calls may follow some text
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls, spans = [], []
        for m in self._CALL.finditer(text):
            try:
                call = _call_from(json.loads(m.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
                spans.append(m.span())
        content = text
        for a, b in reversed(spans):
            content = content[:a] + content[b:]
        return content.strip(), calls

    def render(self, calls: list[dict]) -> str:
        return "\n".join(f"<tool_call>\n{json.dumps({'name': c['name'], 'arguments': c['arguments']})}\n</tool_call>"
                         for c in calls)


class Llama3JsonParser:
    """Llama 3.1+ JSON tool calls: ``[<|python_tag|>]{"name", "parameters"}`` (``;``-separated)."""
    name = "llama3_json"
    start = "{"
    opens_reply = True

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text.strip(), []
        calls, dec, i = [], json.JSONDecoder(), 0
        while i < len(body):
            try:
                obj, end = dec.raw_decode(body, i)
            except json.JSONDecodeError:
                return text.strip(), []
            call = _call_from(obj)
            if call is None:
                return text.strip(), []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return "", calls

    def render(self, calls: list[dict]) -> str:
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)


class MistralParser:
    """Mistral: ``[TOOL_CALLS] [{"name", "arguments"}, ...]`` (the marker is a special token: the
    decoded text may start right at the ``[``)."""
    name = "mistral"
    start = "["
    opens_reply = True

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        head, marker, tail = text.partition("[TOOL_CALLS]")
        body = (tail if marker else head).strip()
        try:
            arr, _ = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            return text.strip(), []
        calls = [_call_from(o) for o in arr] if isinstance(arr, list) else [None]
        if not calls or None in calls:
            return text.strip(), []
        return (head.strip() if marker else ""), calls

    def render(self, calls: list[dict]) -> str:
        return "[TOOL_CALLS] " + json.dumps([{"name": c["name"], "arguments": c["arguments"]} for c in calls])


PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def choose_parser(tokenizer, setting: str | None = None):
    """The parser named by the setting, else by the vocabulary's markers, else Hermes (the
    default format Tandem renders tools in)."""
    if setting:
        if setting not in PARSERS:
            raise ValueError(f"unknown tool parser {setting!r}: one of {', '.join(PARSERS)}")
        return PARSERS[setting]()
    has = getattr(tokenizer, "token_to_id", lambda _: None)
    if has("[TOOL_CALLS]") is not None:
        return MistralParser()
    if has("<|python_tag|>") is not None:
        return Llama3JsonParser()
    return HermesParser()


# ---- the request's plan ---------------------------------------------------------------------


@dataclass
class ToolPlan:
    mode: str                          # "none" | "auto" | "named" | "required"
    tools: list[dict]                  # the request's function definitions ({"name", "description", "parameters"})
    name: str | None = None            # mode "named": the function
    parallel: bool = True              # more than one call allowed

    def guide(self) -> dict | None:
        if self.mode == "named":
            fn = next(t for t in self.tools if t["name"] == self.name)
            return {"kind": "json_schema", "value": _params(fn)}
        if self.mode == "required":
            defs, items = {}, []
            for i, t in enumerate(self.tools):
                args = _params(t)
                if _has_ref(args):   # its "#/$defs/..." pointers are about its own root: it becomes a
                    defs[f"tool{i}"] = _rebased(args, f"#/$defs/tool{i}")   # definition of the array's
                    args = {"$ref": f"#/$defs/tool{i}"}
                items.append({"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": args},
                              "required": ["name", "arguments"], "additionalProperties": False})
            arr = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
            if not self.parallel:
                arr["maxItems"] = 1
            if defs:
                arr["$defs"] = defs
            return {"kind": "json_schema", "value": arr}
        return None


def _has_ref(schema) -> bool:
    if isinstance(schema, dict):
        return isinstance(schema.get("$ref"), str) or any(_has_ref(v) for v in schema.values())
    return isinstance(schema, list) and any(_has_ref(v) for v in schema)


def _rebased(schema, base: str):
    """``schema`` with its local references (``#``, ``#/$defs/X``, ``#/definitions/X``) pointing
    into ``base`` instead of the root: ``required`` nests each tool's parameters in one array
    schema, where pydantic's and the Agents SDK's ``$defs`` pointers found nothing (400)."""
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rebased(v, base) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out


def _params(fn: dict) -> dict:
    """A function's arguments schema, its objects closed (``closed``); none (or ``{}``) is an
    empty parameter list, as OpenAI's: the arguments are ``{}`` (an open object let the model
    write any, and never end)."""
    return closed(fn.get("parameters") or {"type": "object", "properties": {}})


SAFE_INTEGER = 2 ** 53 - 1   # JSON's exactly representable integers (JavaScript's Number.MAX_SAFE_INTEGER)
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "not", "if", "then", "else", "contains", "additionalItems")


def closed(schema):
    """``schema`` with every object that does not say ``additionalProperties`` (nor
    ``patternProperties``) closed to its declared properties — OpenAI's strict function calling
    and vLLM's default (xgrammar's strict mode) do the same: a grammar that allows any other key
    lets a small model add keys, nested ever deeper, until the token cap, and the call is lost.
    An integer without bounds gets JSON's safe ones, ±(2⁵³ − 1) (16 digits at most: the 135M
    model at temperature 0 wrote ``1000000…`` to the token cap, and the call was lost). A new
    schema; the caller's is not changed."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUBSCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [closed(v) for v in out[k]]
    for k in _SUBSCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: closed(v) for name, v in out[k].items()}
    for k in _SUBSCHEMAS:
        if isinstance(out.get(k), dict):
            out[k] = closed(out[k])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed(out["additionalProperties"])
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"]) \
        or "properties" in out
    if is_object and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    kinds = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if "integer" in kinds and not any(k in out for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        out["minimum"], out["maximum"] = -SAFE_INTEGER, SAFE_INTEGER
    return out


def tool_plan(tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan:
    """Validate ``tools`` / ``tool_choice`` (400 naming the parameter) and decide the mode."""
    fns, names = [], set()
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_param(f"tools[{i}]", "each tool must be {\"type\": \"function\", \"function\": {\"name\", ...}}")
        if not TOOL_NAME.fullmatch(fn["name"]):
            raise bad_param(f"tools[{i}].function.name", f"{fn['name'][:80]!r} is not a valid tool name: "
                            "a-z, A-Z, 0-9, underscores and dashes, at most 64")
        if fn["name"] in names:
            raise bad_param(f"tools[{i}].function.name", f"two tools are named {fn['name']!r}")
        names.add(fn["name"])
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise bad_param(f"tools[{i}].function.parameters", "parameters must be a JSON schema object")
        if fn.get("parameters") and fn["parameters"].get("type", "object") != "object":
            raise bad_param(f"tools[{i}].function.parameters", "parameters must be a JSON schema of type "
                            f"\"object\", got type {fn['parameters'].get('type')!r}")
        fns.append({k: fn[k] for k in ("name", "description", "parameters") if k in fn})
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        choice, fns = _allowed(choice.get("allowed_tools"), fns)
    if choice == "none" or not fns:
        if choice not in ("none", "auto"):
            raise bad_param("tool_choice", "tool_choice needs tools")
        return ToolPlan("none", fns)
    if choice in ("auto", "required"):
        return ToolPlan(choice, fns, parallel=parallel is not False)
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_param("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in {f["name"] for f in fns}:
        raise bad_param("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    return ToolPlan("named", fns, name=name, parallel=False)


def _allowed(allowed: Any, fns: list[dict]) -> tuple[str, list[dict]]:
    """``tool_choice: {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}`` -> the mode
    (``auto`` or ``required``) over the listed functions only (the model sees only those)."""
    mode = allowed.get("mode") if isinstance(allowed, dict) else None
    listed = allowed.get("tools") if isinstance(allowed, dict) else None
    if mode not in ("auto", "required") or not isinstance(listed, list) or not listed:
        raise bad_param("tool_choice.allowed_tools", "allowed_tools is {\"mode\": \"auto\" or \"required\", "
                        "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": ...}}, ...]}")
    have, names = {f["name"] for f in fns}, set()
    for j, t in enumerate(listed):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise bad_param(f"tool_choice.allowed_tools.tools[{j}]", "each allowed tool is {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}")
        if name not in have:
            raise bad_param(f"tool_choice.allowed_tools.tools[{j}]", f"{name[:64]!r} is not among the tools")
        names.add(name)
    return mode, [f for f in fns if f["name"] in names]


def turn_guide(plan: ToolPlan, rf: dict | None) -> tuple[dict | None, str]:
    """This turn's guide and the parameter it comes from. A forced call is the turn's whole
    output, so it wins: ``response_format`` shapes text, which a forced turn has none of (agents
    send both: a tool first, then the typed answer on a later turn)."""
    forced = plan.guide()
    return (forced, "tools") if forced is not None else (response_format_guide(rf), "response_format")


def response_format_guide(rf: dict | None) -> dict | None:
    """``response_format`` -> a guide (400 for a bad one)."""
    if rf is not None and "type" not in rf:
        raise bad_param("response_format.type", "response_format needs a type: text, json_object or json_schema")
    kind = (rf or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"kind": "json_object", "value": None}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict) or not isinstance(js.get("name"), str):
            raise bad_param("response_format.json_schema", "json_schema must be {\"name\", \"schema\": {...}, \"strict\"}")
        return {"kind": "json_schema", "value": js.get("schema") or {}}
    raise bad_param("response_format.type", f"unknown response_format type {kind!r}: text, json_object or json_schema")


# ---- prompts --------------------------------------------------------------------------------

DEFAULT_TOOLS_BLOCK = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_takes_tools(template: str | None) -> bool:
    if not template:
        return False
    from jinja2 import Environment, meta
    try:
        return "tools" in meta.find_undeclared_variables(Environment().parse(template))
    except Exception:  # a template jinja2 cannot parse plainly: render tools ourselves
        return False


def _arguments(call: dict) -> Any:
    args = call.get("function", {}).get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return args


def render_messages(messages: list[dict], plan: ToolPlan, parser, native: bool) -> tuple[list[dict], dict]:
    """(messages for the chat template, extra template variables). ``native``: the template
    takes ``tools`` itself. Assistant ``tool_calls`` and ``tool`` messages are rendered for
    templates that do not know them."""
    shown = [{"type": "function", "function": f} for f in plan.tools] if plan.mode != "none" else []
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                    "function": {"name": c["function"]["name"], "arguments": _arguments(c)}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out, ({"tools": shown} if shown else {})
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = parser.render([{"name": c["function"]["name"], "arguments": _arguments(c)} for c in m["tool_calls"]])
            out.append({"role": "assistant", "content": "\n".join(x for x in (m.get("content"), calls) if x)})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    if shown:
        block = DEFAULT_TOOLS_BLOCK.format(tools="\n".join(json.dumps(t) for t in shown))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, {}


# ---- one choice's output --------------------------------------------------------------------


class ChoiceTools:
    """Text deltas of one choice -> (content delta, [tool_call delta]) in OpenAI's streaming
    shape; ``finish()`` flushes what was held back. ``calls`` / ``content`` hold the result.

    The same object turns a whole text into the non-streamed message (one ``feed``, then
    ``finish``), so the streamed calls always assemble to the non-streamed ones. A forced call
    (``named`` / ``required``) is sent once it is complete — the grammar's JSON is never content:
    a call cut by ``max_tokens`` is dropped (the calls before it stay, ``finish_reason: length``),
    and a choice cut before its first call is complete has no calls and no content."""

    def __init__(self, plan: ToolPlan, parser):
        self.plan, self.parser = plan, parser
        self.calls: list[ToolCall] = []
        self.content = ""
        self._buf = ""            # text held back (a call being written)
        self._holding = False
        self._pos = 0             # required: where the next array item starts in _buf (0: before "[")

    @property
    def forced(self) -> bool:
        return self.plan.mode in ("named", "required")

    def feed(self, text: str) -> tuple[str, list[dict]]:
        mode = self.plan.mode
        if mode == "none" or not text:
            self.content += text
            return text, []
        self._buf += text
        if mode == "required":
            return "", self._complete_items() if "}" in text else []
        if mode == "named" or self._holding:
            return "", []
        # auto: pass content through until the family's start marker (or a possible prefix of it)
        start = self.parser.start
        if self.parser.opens_reply:  # a call can only open the reply
            if not self._buf.strip() and not self.content:
                return "", []
            if not self.content and self._buf.lstrip().startswith(start):
                self._holding = True
                return "", []
            out, self._buf = self._buf, ""
        else:
            i = self._buf.find(start)
            if i != -1:
                self._holding = True
                out, self._buf = self._buf[:i], self._buf[i:]
            else:
                keep = next((k for k in range(min(len(start) - 1, len(self._buf)), 0, -1)
                             if self._buf.endswith(start[:k])), 0)
                out, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        self.content += out
        return out, []

    def _emit(self, calls: list[ToolCall]) -> list[dict]:
        deltas = []
        for c in calls:
            i = len(self.calls)
            self.calls.append(c)
            deltas.append({"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}})
            deltas.append({"index": i, "function": {"arguments": c.arguments}})
        return deltas

    def _complete_items(self) -> list[dict]:
        """``required``: the array items of ``_buf`` completed since the last call, as calls."""
        buf, dec, calls = self._buf, json.JSONDecoder(), []
        if self._pos == 0:
            i = len(buf) - len(buf.lstrip())
            if not buf[i:i + 1] == "[":
                return []
            self._pos = i + 1
        while True:
            i = self._pos
            while i < len(buf) and buf[i] in " \n\t\r,":
                i += 1
            if i >= len(buf) or buf[i] == "]":
                break
            try:
                obj, end = dec.raw_decode(buf, i)
            except json.JSONDecodeError:  # not complete yet (or cut)
                break
            self._pos = end
            call = _call_from(obj)
            if call is not None:  # the grammar allows nothing else; a bad item is skipped, never text
                calls.append(call)
        return self._emit(calls)

    def finish(self) -> tuple[str, list[dict]]:
        mode = self.plan.mode
        if mode == "none":
            return "", []
        if mode == "required":
            deltas = self._complete_items()
            self._buf = ""
            return "", deltas
        buf, self._buf = self._buf, ""
        if mode == "named":
            try:
                args = json.loads(buf)
            except json.JSONDecodeError:  # cut by max_tokens: no call
                return "", []
            # the text is the arguments, exactly as generated (the grammar made it one JSON object)
            return "", self._emit([ToolCall(self.plan.name, buf)] if isinstance(args, dict) else [])
        text, calls = self.parser.parse(buf)
        if not calls:
            text = buf
        self.content += text
        return text, self._emit(calls)
