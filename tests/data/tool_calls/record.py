"""Re-records the Qwen2.5-Coder outputs in this folder: runs `build/serval serve` on the cached models
and writes each reply's raw text (the server does not parse tool calls yet). See README.md."""
import json
import pathlib
import subprocess
import sys
import time
import urllib.request

import jinja2

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
CACHE = pathlib.Path.home() / ".cache" / "serval" / "models"
QWEN_TEMPLATE = ROOT / "tests" / "data" / "chat_templates" / "qwen2.5.jinja"
TOOLS = json.loads((HERE / "tools.json").read_text())["weather"]
HISTORY = [  # an earlier turn with calls, as an agent loop would send it
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 18}"},
    {"role": "assistant", "content": "It is 18 °C in Paris."},
    {"role": "user", "content": "What time is it in Berlin and in Lisbon?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"city": "Berlin"}}},
        {"id": "call_3", "type": "function", "function": {"name": "get_time", "arguments": {"city": "Lisbon"}}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {"role": "tool", "tool_call_id": "call_3", "content": "13:05"},
    {"role": "assistant", "content": "It is 14:05 in Berlin and 13:05 in Lisbon."}]

# file: (model, template: "model" or "qwen2.5", kind, user message or history+message, temperature, seed, max_tokens)
CASES = {
    "hermes_coder15_fence.txt": ("1.5b", "model", "chat", "What's the weather in Paris?", 0.0, 1, 300),
    "hermes_coder15_double_brace.txt": ("1.5b", "model", "chat", "What's the weather in Paris?", 0.8, 1, 300),
    "hermes_coder15_fence_two_calls.txt": ("1.5b", "model", "chat", "Get the time in Sydney and the weather in Lima.", 0.8, 3, 300),
    "hermes_coder15_unknown_function.txt": ("1.5b", "model", "chat", "Tell me a joke about cats.", 0.0, 1, 300),
    "hermes_coder15_prose_only.txt": ("1.5b", "model", "chat", "Before calling any tool, write one sentence saying what you will do. Then get the weather in Rome.", 0.8, 1, 300),
    "hermes_coder15_two_objects.txt": ("1.5b", "qwen2.5", "chat", "Get the time in Sydney and the weather in Lima.", 0.8, 1, 300),
    "hermes_coder15_comma_objects.txt": ("1.5b", "qwen2.5", "chat", "Get the time in Sydney and the weather in Lima.", 0.8, 3, 300),
    "hermes_coder05_content_then_calls.txt": ("0.5b", "qwen2.5", "history", "Now the weather in Tokyo and in Oslo, please.", 0.0, 1, 300),
    "hermes_coder05_tag_unclosed.txt": ("0.5b", "qwen2.5", "prefill", "Get the time in Sydney and the weather in Lima.", 0.0, 1, 200),
    "hermes_coder05_tag_truncated.txt": ("0.5b", "qwen2.5", "prefill", "Get the time in Sydney and the weather in Lima.", 0.0, 1, 12),
    "hermes_coder05_tag_unknown_function.txt": ("0.5b", "qwen2.5", "prefill", "Get the stock price of Apple.", 0.0, 1, 200),
}


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=600))["choices"][0]


def reply(port, kind, message, temperature, seed, max_tokens):
    params = {"temperature": temperature, "seed": seed, "max_tokens": max_tokens}
    if kind == "prefill":  # the assistant turn starts with "<tool_call>\n"; the model writes the rest
        prompt = jinja2.Environment().from_string(QWEN_TEMPLATE.read_text()).render(
            messages=[{"role": "user", "content": message}], tools=TOOLS, add_generation_prompt=True)
        return "<tool_call>\n" + post(port, "/v1/completions", {"prompt": prompt + "<tool_call>\n", **params})["text"]
    messages = (HISTORY if kind == "history" else []) + [{"role": "user", "content": message}]
    return post(port, "/v1/chat/completions", {"messages": messages, "tools": TOOLS, **params})["message"]["content"]


def main():
    only = set(sys.argv[1:])
    configs = sorted({(c[0], c[1]) for f, c in CASES.items() if not only or f in only})
    for model, template in configs:
        port = 18500
        cmd = [str(ROOT / "build" / "serval"), "serve", str(CACHE / f"qwen2.5-coder-{model}-instruct.gguf"),
               "--port", str(port), "--kv-cache-memory", "256MiB"]
        if template != "model":
            cmd += ["--chat-template", str(QWEN_TEMPLATE)]
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(300):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except OSError:
                    time.sleep(0.2)
            for file, (m, t, kind, message, temperature, seed, max_tokens) in CASES.items():
                if (m, t) == (model, template) and (not only or file in only):
                    text = reply(port, kind, message, temperature, seed, max_tokens)
                    (HERE / file).write_text(text)
                    print(file, repr(text))
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
