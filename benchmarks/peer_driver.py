"""Runs inside ANOTHER interpreter (e.g. a virtualenv with the PyPI kvboost 0.9.0) for `bench multiturn --peer-python`.

Protocol: argv[1] = model directory; prints one JSON line when ready, then answers each JSON request line
{"prompt", "max_new_tokens"} with {"ttft_ms", "kv_reuse_ratio", "output_text"}. It imports whatever
`kvboost` that interpreter has, never this repository's (it is run by path, not as a module).
"""
import json
import sys


def main() -> None:
    import kvboost  # the peer's package

    try:
        engine = kvboost.KVBoost.from_pretrained(sys.argv[1])
    except TypeError as exc:
        if "max_cache_bytes" not in str(exc):
            raise
        # kvboost 0.9.0 has no default byte budget; give it the same 4 GiB our default allows at most.
        engine = kvboost.KVBoost.from_pretrained(sys.argv[1], max_cache_bytes=4 * 1024**3)
    print(json.dumps({"ready": True, "package": getattr(kvboost, "__file__", "?")}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        r = engine.generate(request["prompt"], max_new_tokens=request["max_new_tokens"])
        print(json.dumps({"ttft_ms": float(r.ttft_ms), "kv_reuse_ratio": float(r.kv_reuse_ratio),
                          "output_text": r.output_text}), flush=True)


if __name__ == "__main__":
    main()
