# Stream a chat completion from a local dsuf server and print the text and the token usage.
import json
import urllib.request

body = {
    "model": "deepseek-v4.1-flash",
    "messages": [{"role": "user", "content": "Say hello in one short sentence."}],
    "max_tokens": 16,
    "stream": True,
    "stream_options": {"include_usage": True},
}
req = urllib.request.Request("http://localhost:8000/v1/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req) as resp:
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk["choices"]:
            print(choice["delta"].get("content") or "", end="", flush=True)
        if chunk.get("usage"):
            print("\nusage:", chunk["usage"])
