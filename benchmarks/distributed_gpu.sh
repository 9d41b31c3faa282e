#!/usr/bin/env bash
# ZeRO-3 and FSDP2 through DistillationTrainer.train() on one CUDA GPU (world_size=1), 20 steps each, then
# push_to_hub (with the card) to the local test Hub (tests/hub_server.py). Writes
# benchmarks/results/distributed_gpu.{json,log}; benchmarks/distributed.py adds its rows to distributed.md.
# Under 5 minutes on one H100 (tiny models; DeepSpeed JIT-builds cpu_adam once for the template's offload).
#
#   bash benchmarks/distributed_gpu.sh             # needs torch (CUDA), transformers, accelerate, datasets,
#   WHEELS=dir bash benchmarks/distributed_gpu.sh  # deepspeed; WHEELS: install these offline first
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=benchmarks/results
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
if [[ -n "${WHEELS:-}" ]]; then $PY -m pip install --no-index --find-links "$WHEELS" deepspeed datasets transformers; fi
$PY - <<'EOF' | tee "$OUT/distributed_gpu.log"
import torch, transformers, accelerate, deepspeed  # noqa: E401 - fail here, early, when one is missing
print("gpu:", torch.cuda.get_device_name(0), "torch", torch.__version__, "transformers", transformers.__version__,
      "accelerate", accelerate.__version__, "deepspeed", deepspeed.__version__)
EOF
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_DISABLE_XET=1 HF_TOKEN=hf_test OMP_NUM_THREADS=4

# The local Hub: a FakeHub serving until this script ends; it writes the pushed repos' file names on exit.
$PY - "$TMP/hub" <<'EOF' &
import json, signal, sys, time
sys.path.insert(0, "tests")
from hub_server import FakeHub
with FakeHub() as hub:
    open(sys.argv[1] + ".url", "w").write(hub.endpoint)
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(SystemExit))
    try:
        while True:
            time.sleep(0.2)
            json.dump({r: sorted(v["revisions"]["main"]) for r, v in hub.repos.items()}, open(sys.argv[1] + ".json", "w"))
    except SystemExit:
        pass
EOF
HUB_PID=$!
for _ in $(seq 50); do [[ -f "$TMP/hub.url" ]] && break; sleep 0.2; done
export HF_ENDPOINT=$(cat "$TMP/hub.url") HF_HUB_OFFLINE=0

status=0
run() {  # name, launcher..., -- engine_run args...
  local name=$1; shift
  local start=$(date +%s)
  if "$@" >"$TMP/$name.log" 2>&1; then echo "$name: ok ($(( $(date +%s) - start )) s)" | tee -a "$OUT/distributed_gpu.log";
  else echo "$name: FAILED" | tee -a "$OUT/distributed_gpu.log"; tail -20 "$TMP/$name.log"; status=1; fi
  tail -c 20000 "$TMP/$name.log" >> "$OUT/distributed_gpu.log"
}
TORCHRUN=($PY -m torch.distributed.run --nproc_per_node 1 --master_port 29731)
# The template's AdamW takes the Trainer's learning rate: 1e-3 (engine_run's default 0.5 is for its SGD comparisons).
run zero3 timeout 150 "${TORCHRUN[@]}" tests/engine_run.py "$TMP/zero3" --engine zero3 --gpu --steps 20 \
  --deepspeed_config tests/configs/zero3_hf_template.json --push_to user/zero3-gpu --learning_rate 1e-3
run zero3_projection timeout 150 "${TORCHRUN[@]}" tests/engine_run.py "$TMP/zero3_projection" --engine zero3 --gpu \
  --steps 20 --deepspeed_config tests/configs/zero3_auto_no_optimizer.json --student_width 16 --resume_check
run fsdp2 timeout 120 "${TORCHRUN[@]}" tests/engine_run.py "$TMP/fsdp2" --engine fsdp2 --gpu --steps 20 \
  --push_to user/fsdp2-gpu
kill "$HUB_PID"; wait "$HUB_PID" || true

$PY - "$TMP" <<'EOF'
import json, sys
from pathlib import Path
tmp = Path(sys.argv[1])
pushed = json.loads((tmp / "hub.json").read_text()) if (tmp / "hub.json").exists() else {}
runs = []
for name, repo in (("zero3", "user/zero3-gpu"), ("zero3_projection", None), ("fsdp2", "user/fsdp2-gpu")):
    f = tmp / name / "result.json"
    if not f.exists():
        log = (tmp / f"{name}.log").read_text().strip().splitlines()
        # the rank's own exception, not the launcher's ChildFailedError that wraps it
        err = [l for l in log if "Error" in l and "ChildFailedError" not in l] or log[-1:]
        runs.append({"engine": f"{name} (GPU)", "ran": "no", "where": "1 CUDA GPU", "error": err[-1] if err else ""})
        continue
    r = json.loads(f.read_text())
    runs.append({
        "engine": f"{name} (GPU, HF ZeRO-3 template)" if name == "zero3" else f"{name} (GPU)", "ran": "yes",
        "where": f"{r['device']}, {r['world_size']} process", "distributed_type": r["distributed_type"],
        "steps": r["steps"], "terms": r["terms"], "teacher_type": r["teacher_type"],
        "student_wrapped_type": r["wrapped_type"],
        "teacher_bytes_per_rank": [x["teacher_bytes"] for x in r["ranks"]],
        "student_bytes_per_rank": [x["student_bytes"] for x in r["ranks"]],
        "peak_memory_bytes_per_rank": [x["peak_memory_bytes"] for x in r["ranks"]],
        "train_wall_s": round(r["wall_s"], 2), "pushed_files": pushed.get(repo, []) if repo else None,
        "final_losses": {k: v for k, v in r["logs"][-1].items() if k.startswith("loss")},
        "resumed_max_abs_diff": max((abs(a - b) for a, b in zip(r["resumed"]["student"] + r["resumed"]["projections"],
                                                               r["student"] + r["projections"])), default=None)
        if r.get("resumed") else None,
    })
import accelerate, deepspeed, torch, transformers  # noqa: E401
from datetime import datetime, timezone
machine = {"gpu": torch.cuda.get_device_name(0), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "accelerate": accelerate.__version__, "deepspeed": deepspeed.__version__}
Path("benchmarks/results/distributed_gpu.json").write_text(json.dumps({"machine": machine, "runs": runs}, indent=2) + "\n")
print(json.dumps(runs, indent=1)[:3000])
EOF
exit $status
