"""Tool-call formats over HTTP with the official openai client: Qwen3-Coder's XML calls
(`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>...`), taken from the chat template
(tests/data/chat_templates/qwen3-coder-mini.jinja: the tool-call parts of Qwen3-Coder's template; the
whole template renders as Jinja2 in test_llama_cpp_assets.py), on Qwen2.5-Coder-0.5B (the tiny family
models' vocabulary has no '='): `tool_choice: "required"` constrains it to one call, whose arguments
come back typed by the schema; a named function is the one called; the streamed call equals the whole one.
"""
import json

import openai

from conftest import DATA, cached_model
from server_util import Server

TOOLS = [{"type": "function", "function": {"name": "forecast", "description": "Days of forecast",
          "parameters": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                                          "days": {"type": "integer"}}, "required": ["unit", "days"]}}},
         {"type": "function", "function": {"name": "alert", "parameters": {"type": "object", "properties": {
             "urgent": {"type": "boolean"}}, "required": ["urgent"]}}}]


def test_qwen3_coder_xml_calls():
    server = Server(cached_model("qwen2.5-coder-0.5b-instruct"), "--chat-template",
                    DATA / "chat_templates" / "qwen3-coder-mini.jinja")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        model = client.models.list().data[0].id
        ask = dict(model=model, max_tokens=64, temperature=0, messages=[{"role": "user", "content": "Forecast?"}], tools=TOOLS)
        r = client.chat.completions.create(**ask, tool_choice="required")
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        (call,) = r.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        if call.function.name == "forecast":
            assert args["unit"] in ("celsius", "fahrenheit") and isinstance(args["days"], int), args
        else:
            assert call.function.name == "alert" and isinstance(args["urgent"], bool), args
        r = client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "alert"}})
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "alert" and isinstance(json.loads(call.function.arguments)["urgent"], bool)
        whole = call.function.arguments
        chunks = client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "alert"}}, stream=True)
        streamed, names = "", []
        for chunk in chunks:
            for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                names += [tc.function.name] if tc.function and tc.function.name else []
                streamed += tc.function.arguments or "" if tc.function else ""
        assert names == ["alert"] and json.loads(streamed) == json.loads(whole)
    finally:
        server.stop()
