"""Issue 75, finding 4: generation under a competing process, with fedsyn's OpenMP wait policy.

Loads the default writer (SmolLM2) and writes 8 texts of 48 new tokens, printing the generation's
seconds. ``--before`` imports torch before fedsyn, so libgomp loads before ``common.threads`` sets
``GOMP_SPINCOUNT`` (the code without the fix); without it, fedsyn first (the fix). Time both
idle and beside one busy process (e.g. ``yes > /dev/null``), whole process, pair by pair:

    python -m benchmarks.wait_policy [--before] [--texts 8] [--tokens 48]

With ``--before`` the variables are libgomp's own: set ``GOMP_SPINCOUNT`` (or ``OMP_WAIT_POLICY``) in the
environment to time another policy.
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

    texts = int(sys.argv[sys.argv.index("--texts") + 1]) if "--texts" in sys.argv else 8
    tokens = int(sys.argv[sys.argv.index("--tokens") + 1]) if "--tokens" in sys.argv else 48
    model, tok = load_generator()
    ids = tok(["Write a news article about sport:"] * texts, return_tensors="pt", padding=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(**ids, max_new_tokens=tokens, do_sample=True, pad_token_id=tok.eos_token_id)
    print(f"generate {time.perf_counter() - t0:.2f}s")


if __name__ == "__main__":
    main()
