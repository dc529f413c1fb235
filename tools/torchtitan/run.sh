#!/usr/bin/env bash
# TorchTitan 0.3.0 llama3 debug model on "cpu" (gloo) or "tpu" (torch_tpu + tpud), 5 steps, seq 256.
#
#   tools/torchtitan/run.sh LAYOUT DEVICE     LAYOUT: 1 | fsdp4 | tp2   DEVICE: cpu | tpu
#
# Side venv /tmp/ttvenv (sees .venv's torch/torch_tpu through a .pth; TorchTitan --no-deps plus
# its deps), test assets in /tmp/ttassets (tokenizer from github:pytorch/torchtitan; c4_test is
# not in the snapshot, so a stand-in of /usr/share/common-licenses paragraphs is used).
# spmd_backend partial_dtensor: the default (spmd_types) makes torch 2.13 FSDP2 reject plain
# params ("all parameters must be DTensors on the full SPMD mesh").
# Same init on both devices: a CPU seed checkpoint (/tmp/ttout/seed), loaded by every run.
# tpu: start tpud first and export its sockets, e.g.
#   bazel-bin/daemon/tpud --socket=/tmp/ttd/s --admin_socket=/tmp/ttd/a --hbm_bytes=4GiB --log_level=warn &
#   export TPUD_SOCKET=/tmp/ttd/s TPUD_ADMIN_SOCKET=/tmp/ttd/a
# launch.py: TT_DEVICE=cpu forces cpu (TorchTitan has no device flag) + a set_timeout shim for
# torch 2.13 (and gloo-safe FSDP reduce-scatter); dense_attention.py: --override.imports swapping flex attention for masked SDPA.
# Log: $TT_OUT/<device>_<layout>.log (TT_OUT default /tmp/ttout); step time: the gap between the
# step log lines (the logged tps is per rank and, with TP, divided by the TP degree).
set -euo pipefail
LAYOUT=${1:?layout: 1|fsdp4|tp2}; DEVICE=${2:?device: cpu|tpu}
HERE=$(cd "$(dirname "$0")" && pwd); MAIN=$(cd "$HERE/../.." && pwd)
V=/tmp/ttvenv; A=/tmp/ttassets; O=${TT_OUT:-/tmp/ttout}
if [ ! -x $V/bin/python ]; then
  "$MAIN/.venv/bin/python" -m venv $V
  echo "$MAIN/.venv/lib/python3.11/site-packages" > $V/lib/python3.11/site-packages/mainvenv.pth
  $V/bin/pip install --no-deps torchtitan==0.3.0
  $V/bin/pip install tyro einops spmd_types torchdata torch_checkpointing safetensors \
    docstring_parser triton datasets tensorboard
fi
if [ ! -f $A/tests/assets/c4_test/data.json ]; then
  mkdir -p $A/tests/assets/c4_test
  $V/bin/python - <<'PY'
import glob, json, os
with open('/tmp/ttassets/tests/assets/c4_test/data.json', 'w') as o:
    i = 0
    for f in sorted(glob.glob('/usr/share/common-licenses/*')):
        if os.path.islink(f) or not os.path.isfile(f): continue
        for p in open(f, errors='replace').read().split('\n\n'):
            p = ' '.join(p.split())
            if len(p) > 200:
                o.write(json.dumps({"text": p, "timestamp": "2019-01-01T00:00:00Z", "url": f"local://{i}"}) + "\n"); i += 1
PY
fi
[ -f $A/tests/assets/tokenizer/tokenizer.json ] || {
  echo "copy tests/assets/tokenizer from github:pytorch/torchtitan to $A/tests/assets/tokenizer"; exit 1; }
case $LAYOUT in
  1) N=1; PAR=() ;;
  fsdp4) N=4; PAR=(--parallelism.data_parallel_shard_degree 4) ;;
  tp2) N=2; PAR=(--parallelism.tensor_parallel_degree 2) ;;
  *) echo "bad layout $LAYOUT"; exit 2 ;;
esac
COMMON=(--module llama3 --config llama3_debugmodel --override.imports dense_attention.dense_flex_attention
        --training.seq_len 256 --training.steps 5 --debug.seed 42 --parallelism.spmd_backend partial_dtensor ${TT_EXTRA:-})
export PYTHONPATH=$HERE TT_DEVICE=$DEVICE
# cpu reference: keep torch_tpu out (else torch.accelerator is tpu and TorchTitan's
# barrier(device_ids=...) on the gloo group fails: "No backend type associated with device type tpu")
[ "$DEVICE" = cpu ] && { export TORCH_DEVICE_BACKEND_AUTOLOAD=0; unset TPUD_SOCKET TPUD_ADMIN_SOCKET; }
cd $A && mkdir -p $O
if [ ! -d $O/seed/checkpoint/step-0 ]; then
  TT_DEVICE=cpu TORCH_DEVICE_BACKEND_AUTOLOAD=0 TPUD_SOCKET= $V/bin/python -m torch.distributed.run --nproc_per_node 1 $HERE/launch.py "${COMMON[@]}" \
    --checkpoint.enable --checkpoint.create_seed_checkpoint --dump_folder $O/seed > $O/seed.log 2>&1
fi
rm -rf $O/${DEVICE}_$LAYOUT
$V/bin/python -m torch.distributed.run --nproc_per_node $N $HERE/launch.py "${COMMON[@]}" "${PAR[@]}" \
  --checkpoint.enable --checkpoint.initial_load_path $O/seed/checkpoint/step-0 \
  --dump_folder $O/${DEVICE}_$LAYOUT > $O/${DEVICE}_$LAYOUT.log 2>&1 && rc=0 || rc=$?
grep -a "step: " $O/${DEVICE}_$LAYOUT.log | grep -E "rank0|^\[titan\]" | sed 's/\x1b\[[0-9;]*m//g' | awk '!seen[$10]++' | cut -d' ' -f9-
[ $rc = 0 ] || { grep -a -m3 -E "Error|error" $O/${DEVICE}_$LAYOUT.log; echo "FAILED rc=$rc (log $O/${DEVICE}_$LAYOUT.log)"; }
exit $rc
