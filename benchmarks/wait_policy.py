"""Issue 75, finding 4: generation under a competing process, with fedsyn's OpenMP wait policy.

Loads the default writer (SmolLM2) and writes 8 texts of 48 new tokens, printing the generation's
seconds. ``--before`` imports torch before fedsyn, so libgomp loads before ``common.threads`` sets
``OMP_WAIT_POLICY`` (today's code without the fix); without it, fedsyn first (the fix). Time both
idle and beside one busy process (e.g. ``yes > /dev/null``), whole process, pair by pair:

    python -m benchmarks.wait_policy [--before]
"""

from __future__ import annotations

import importlib
import sys
import time


def main() -> None:
    """Generate once and print the seconds it took."""
    # the order is the point: torch first reproduces the code before the fix
    for name in (("torch", "common") if "--before" in sys.argv else ("common", "torch")):
        importlib.import_module(name)
    import torch

    from common.models import load_generator

    model, tok = load_generator()
    ids = tok(["Write a news article about sport:"] * 8, return_tensors="pt", padding=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(**ids, max_new_tokens=48, do_sample=True, pad_token_id=tok.eos_token_id)
    print(f"generate {time.perf_counter() - t0:.2f}s")


if __name__ == "__main__":
    main()
