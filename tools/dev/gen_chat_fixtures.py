"""Write tests/fixtures/chat/cases.json from DeepSeek's reference chat encoders.

The reference code is not part of this repo: pass the folder holding local copies of
sglang's `encoding_dsv4.py` and `encoding_dsv41.py` (python/sglang/srt/entrypoints/openai/).

    python3 tools/dev/gen_chat_fixtures.py /path/to/ref [out.json]

Our API differs from the reference's in two ways, mapped here: `tools`/`response_format`
are attached to the leading system message (inserted when missing), and
add_generation_prompt=False drops the trailing `<｜Assistant｜><think>|</think>`.
V4.1 budgets are set to the released checkpoint's (low=50, high=75, max=100); sglang's
copy carries low=25/high=50/xhigh=75.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Web search — returns snippets",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}


def call(cid: str, name: str, args: dict) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


U = [{"role": "user", "content": "Hello! Wie geht's? 你好 🌍"}]
SYS_U = [{"role": "system", "content": "You are a helpful assistant."}] + U
MULTI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "1+1?"},
    {"role": "assistant", "content": "2", "reasoning_content": "one plus one is two"},
    {"role": "user", "content": "and 2+2?"},
]
TOOL_LOOP = [
    {"role": "system", "content": "You can use tools."},
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should call the tool twice.",
        "tool_calls": [
            call("c1", "get_weather", {"city": "Paris", "days": 2}),
            call("c2", "get_weather", {"city": "東京", "opts": {"units": "C", "x": [1, True, None]}}),
        ],
    },
    # Results arrive out of call order: the reference sorts them by call order.
    {"role": "tool", "tool_call_id": "c2", "content": "晴れ 21C"},
    {"role": "tool", "tool_call_id": "c1", "content": "rain 14C"},
]
TOOL_DONE = TOOL_LOOP + [
    {"role": "assistant", "content": "Paris: rain, Tokyo: sunny.", "reasoning_content": "summarise"},
    {"role": "user", "content": "Thanks. And Rome?"},
]
DEV = [
    {"role": "user", "content": "I need help."},
    {"role": "assistant", "content": "Sure, send the text.", "reasoning_content": "wait for text"},
    {"role": "developer", "content": "Start your answer with OK."},
    {"role": "user", "content": "What is my name?"},
]
DEV_LAST = [{"role": "user", "content": "hi"}, {"role": "developer", "content": "Answer in French."}]
TWO_USERS = [{"role": "user", "content": "first part"}, {"role": "user", "content": "second part"}]
ENDS_ASSISTANT = MULTI + [{"role": "assistant", "content": "4", "reasoning_content": "two plus two"}]
TOOL_RESULT_THEN_TEXT = TOOL_LOOP + [{"role": "user", "content": "Also: which is warmer?"}]
MID_SYSTEM = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
    {"role": "system", "content": "New rule: answer in one word."},
]
REMINDER = [{"role": "user", "content": "A"}, {"role": "latest_reminder", "content": "be nice"}]
PREFILL = U + [{"role": "assistant", "content": "Partial ans", "wo_eos": True}]
RAW_ARGS = [
    {"role": "user", "content": "go"},
    {
        "role": "assistant",
        "content": "calling",
        "tool_calls": [call("x1", "search", {"q": "a \"quoted\" <tag> & stuff\nline2"})],
    },
    {
        "role": "tool",
        "tool_call_id": "x1",
        "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}],
    },
]


def cases() -> list[dict]:
    out = []

    def add(name, arch, msgs, thinking, **kw):
        out.append({"name": f"{arch}-{name}", "arch": arch, "thinking": thinking, "messages": msgs, **kw})

    for arch in ("v4", "v41"):
        add("user-chat", arch, U, False)
        add("user-think", arch, U, True)
        add("sys-chat", arch, SYS_U, False)
        add("sys-think", arch, SYS_U, True)
        add("multi-think-drops-reasoning", arch, MULTI, True)
        add("multi-chat", arch, MULTI, False)
        add("tools-think", arch, SYS_U, True, tools=[WEATHER, SEARCH])
        add("tools-no-system-chat", arch, U, False, tools=[WEATHER])
        add("tool-loop-think", arch, TOOL_LOOP, True, tools=[WEATHER])
        add("tool-loop-chat", arch, TOOL_LOOP, False, tools=[WEATHER])
        add("tool-done-think", arch, TOOL_DONE, True, tools=[WEATHER])
        add("tool-result-then-text", arch, TOOL_RESULT_THEN_TEXT, True, tools=[WEATHER])
        add("tool-history-no-tools-think", arch, TOOL_DONE, True)
        add("raw-args-chat", arch, RAW_ARGS, False)
        add("developer-think", arch, DEV, True)
        add("developer-chat", arch, DEV, False)
        add("developer-last", arch, DEV_LAST, True)
        add("two-users", arch, TWO_USERS, False)
        add("response-format-sys", arch, SYS_U, False, response_format=SCHEMA)
        add("response-format-and-tools", arch, U, True, response_format=SCHEMA, tools=[SEARCH])
        add("ends-assistant-think", arch, ENDS_ASSISTANT, True)
        add("no-generation-prompt", arch, MULTI, True, add_generation_prompt=False)
        add("reminder", arch, REMINDER, False)
        add("prefill-wo-eos", arch, PREFILL, True)
        add("effort-max-chat", arch, SYS_U, False, reasoning_effort="max")
        add("effort-max-think", arch, MULTI, True, reasoning_effort="max")
        add("effort-high-think", arch, SYS_U, True, reasoning_effort="high")
    add("mid-system-think", "v41", MID_SYSTEM, True, reasoning_effort=88)
    add("mid-system-chat", "v41", MID_SYSTEM, False)
    for effort in ("low", 1, 42, 100):
        add(f"effort-{effort}-think", "v41", U, True, reasoning_effort=effort)
    return out


def reference_prompt(ref: dict, case: dict) -> str:
    msgs = copy.deepcopy(case["messages"])
    if case.get("tools") or case.get("response_format"):
        if not (msgs and msgs[0]["role"] == "system"):
            msgs.insert(0, {"role": "system", "content": ""})
        if case.get("tools"):
            msgs[0]["tools"] = case["tools"]
        if case.get("response_format"):
            msgs[0]["response_format"] = case["response_format"]
    mode = "thinking" if case["thinking"] else "chat"
    encoder = ref[case["arch"]]
    prompt = encoder.encode_messages(msgs, thinking_mode=mode, reasoning_effort=case.get("reasoning_effort"))
    if case.get("add_generation_prompt") is False:
        for tail in ("<｜Assistant｜><think>", "<｜Assistant｜></think>"):
            if prompt.endswith(tail):
                prompt = prompt[: -len(tail)]
                break
    return prompt


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(f"_ref_{name}", path / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ref_dir = Path(sys.argv[1])
    default = Path(__file__).parents[1] / "tests/fixtures/chat/cases.json"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else default
    ref = {"v4": load(ref_dir, "encoding_dsv4"), "v41": load(ref_dir, "encoding_dsv41")}
    ref["v41"].REASONING_EFFORT_MAPPINGS.clear()
    ref["v41"].REASONING_EFFORT_MAPPINGS.update({"low": 50, "high": 75, "max": 100})
    data = [dict(case, expected=reference_prompt(ref, case)) for case in cases()]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(data)} cases to {out}")


if __name__ == "__main__":
    main()
