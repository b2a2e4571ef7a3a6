#!/usr/bin/env bash
# The GPU checks in one call on a lent GPU machine whose image has torch (CUDA) but not fedsyn:
# `pytest -m gpu`, the throughput table, the default run and the GPU preset (BBC News, seed 0).
# Set-up first: ../shared/gpu/README.md (bundle.sh with flwr==1.42.0, fedsyn's pin), then
#   bash .gpu/env.sh bash benchmarks/gpu_check.sh        (writes its logs and JSON under $OUT)
# Measured 2026-11-27 on an H200: ~6.5 min in all (benchmarks/README.md "On a GPU").
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-}   # ours first: opacus ships a top-level `benchmarks` too
py=$(python3 -c 'import sys; print(sys.executable)'); bindir=$(dirname "$py")
site=${FEDSYN_SITE:-/root/site}
# fedsyn's entry points without installing the project (the image has no build backend)
d=$site/fedsyn-0.1.0.dist-info; mkdir -p "$d"
printf 'Metadata-Version: 2.1\nName: fedsyn\nVersion: 0.1.0\n' > "$d/METADATA"
python3 - "$d/entry_points.txt" <<'PY'
import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
groups = {"console_scripts": p["scripts"], **p["entry-points"]}
open(sys.argv[1], "w").write("\n".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in e.items()) for g, e in groups.items()))
PY
# fedsyn looks for `flwr` beside this Python (flwr_runner.flwr_cli): put every console script there
for name in $(python3 -c "from importlib.metadata import entry_points as e; print(' '.join(x.name for x in e(group='console_scripts') if x.dist and x.dist.name.lower() in ('flwr', 'fedsyn', 'ray')))"); do
  printf '#!/bin/sh\nexec %s -c "import sys; from importlib.metadata import entry_points as e; sys.argv[0] = \\"%s\\"; sys.exit([x for x in e(group=\\"console_scripts\\") if x.name == \\"%s\\"][0].load()())" "$@"\n' \
    "$py" "$name" "$name" > "$bindir/$name"; chmod +x "$bindir/$name"
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$(date +%s)
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 tests/test_gpu.py > "$OUT/pytest_gpu.log" 2>&1
echo "pytest -m gpu: rc $? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
timeout 150 python3 -m benchmarks.throughput --batch-size 64 --steps 3 --generate 240 \
  --json "$OUT/throughput_gpu.json" > "$OUT/throughput.log" 2>&1
echo "throughput: rc $? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu.txt"
(cat presets/gpu.toml; echo 'out-dir = "/root/runs"'; echo 'run-name = "preset"') > /root/preset.toml
for name in default preset; do
  [ "$name" = preset ] && rc=/root/preset.toml || rc='out-dir="/root/runs" run-name="default"'
  t0=$(date +%s)
  timeout 260 fedsyn run . --stream --run-config "$rc" > "$OUT/run_$name.log" 2>&1
  echo "run $name: rc $? $(( $(date +%s) - t0 )) s wall" | tee -a "$OUT/gpu.txt"
done
python3 - <<'PY'
import json, os, pathlib
out = {f"{n}/{f}": json.loads(p.read_text()) for n in ("default", "preset") for f in ("metrics.json", "evaluation.json")
       if (p := pathlib.Path("/root/runs") / n / f).exists()}
pathlib.Path(os.environ["OUT"], "runs.json").write_text(json.dumps(out, indent=1))
PY
