"""Which conversations' histories one llama-server keeps when they take turns: four
conversations on one system prompt, four on four prompts, two and three on one, each sending
three turns in rotation, one request at a time; then one conversation alone, its turns with
nothing between them. Prints the prompt tokens the engine reported
cached (`timings.cache_n`) over the prompt's, per conversation and turn: a later turn that
finds only its system prompt cached has lost its history.

Standard library only. Starts llama-server as the real-engine harness does
(tests/real_engines/llama.rs: one thread, `-c 8192 -np 2`), with any extra arguments given:

    python3 benches/engines/slot_probe.py "$(bash tests/real_engines/setup.sh | tail -1)" [ARG...]

(`-sps 0` is the case docs/real-engines.md compares with the defaults).
"""

import json
import random
import socket
import subprocess
import sys
import time
import urllib.request

WORDS = "order invoice customer refund delivery warranty account payment shipping address".split()
SYSTEM_WORDS = 1_150  # about 1,750 tokens, as the engines bench's system prompts
QUESTION_WORDS = 60
TURNS = 3
CASES = [
    ("four conversations, one system prompt", [0, 0, 0, 0]),
    ("four conversations, four system prompts", [0, 1, 2, 3]),
    ("two conversations, one system prompt", [1, 1]),
    ("three conversations, one system prompt", [2, 2, 2]),
    ("one conversation alone", [3]),
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(setup_dir, extra):
    port = free_port()
    engine = subprocess.Popen(
        [f"{setup_dir}/bin/llama-server", "-m", f"{setup_dir}/tiny-llama.gguf",
         "--alias", "m", "--host", "127.0.0.1", "--port", str(port),
         "-t", "1", "-c", "8192", "-np", "2", "--temp", "0", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(base + "/health").read()
            return engine, base
        except OSError:
            time.sleep(0.3)
    engine.kill()
    sys.exit("llama-server did not come up")


def ask(base, messages):
    body = json.dumps({"model": "m", "messages": messages, "max_tokens": 4}).encode()
    request = urllib.request.Request(base + "/v1/chat/completions", body,
                                     {"content-type": "application/json"})
    answer = json.load(urllib.request.urlopen(request))
    timings = answer["timings"]
    cached = timings["cache_n"]
    return cached, cached + timings["prompt_n"], answer["choices"][0]["message"]["content"]


def main():
    setup_dir, extra = sys.argv[1], sys.argv[2:]
    rng = random.Random(1)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))
    systems = [f"You are assistant {i}. Rules: " + words(SYSTEM_WORDS) for i in range(4)]
    engine, base = start(setup_dir, extra)
    print("llama-server", " ".join(extra) or "(defaults)")
    try:
        name = iter("ABCDEFGHIJKLMN")
        for label, prompts in CASES:
            conversations = {next(name): [{"role": "system", "content": systems[p]}]
                             for p in prompts}
            print(label)
            for turn in range(TURNS):
                row = []
                for c, messages in conversations.items():
                    messages.append({"role": "user",
                                     "content": "Question: " + words(QUESTION_WORDS)})
                    cached, prompt, text = ask(base, messages)
                    messages.append({"role": "assistant", "content": text})
                    row.append(f"{c} {cached}/{prompt}")
                print(f"  turn {turn}: " + ", ".join(row))
    finally:
        engine.kill()


if __name__ == "__main__":
    main()
