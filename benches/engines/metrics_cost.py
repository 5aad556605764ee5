"""What reading an engine's /metrics costs its prefills: one engine, cold prompts sent one at a
time, with nobody reading its page, with a reader every 200 ms (prefixlb's default) and with
one every second, in blocks of four in turn; prints each setting's times to the full answer.

Every prompt starts with its own number, so that no block of it is cached anywhere. Standard
library only; start the engine as `benches/engines/vllm.rs` does (one `--max-num-seqs 2`
vLLM CPU engine serving model `m`), then:

    python metrics_cost.py http://127.0.0.1:PORT [ROUNDS]
"""

import json
import statistics
import sys
import threading
import time
import urllib.request

WORDS = 600  # about 2,300 tokens of the tiny Llama's vocabulary
PER_BLOCK = 4
READERS = {"unread": None, "every 200 ms": 0.2, "every 1 s": 1.0}


def prompt(base, n):
    text = f"r{n} " + " ".join(f"w{j}" for j in range(WORDS))
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    request = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    started = time.monotonic()
    urllib.request.urlopen(request).read()
    return time.monotonic() - started


def read_every(base, period, stop):
    while not stop.is_set():
        urllib.request.urlopen(base + "/metrics").read()
        stop.wait(period)


def main():
    base = sys.argv[1].rstrip("/")
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    times = {name: [] for name in READERS}
    n = 0
    prompt(base, -1)  # the first request warms the server up
    for _ in range(rounds):
        for name, period in READERS.items():
            stop = threading.Event()
            reader = None
            if period is not None:
                reader = threading.Thread(target=read_every, args=(base, period, stop))
                reader.start()
            for _ in range(PER_BLOCK):
                n += 1
                times[name].append(prompt(base, n))
            stop.set()
            if reader:
                reader.join()
    for name, t in times.items():
        print(f"{name}: median {statistics.median(t):.2f} s ({min(t):.2f}-{max(t):.2f}), n={len(t)}")


if __name__ == "__main__":
    main()
