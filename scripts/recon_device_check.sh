#!/bin/bash
# --recon_device cuda on a lent GPU machine: the brecq tests on both devices, then CPU against GPU
# timings on the real PP-OCR models. Two steps:
#   here (prepare, needs the benchmark's caches):
#     python scripts/benchmark.py --task ocr_cls --n-calib 64 --methods dipoorlet:mse --out /tmp/b --shared ../shared/data
#     python scripts/benchmark.py --task ocr_det --n-calib 32 --methods dipoorlet:mse --out /tmp/b --shared ../shared/data
#     bash scripts/recon_device_check.sh prepare /tmp/b      # fills .gpu/ (git-excluded; ~34 MB)
#   there (the device tool's run, carrying .gpu):  bash scripts/recon_device_check.sh run
# Session 40's figures (README, --brecq "On a GPU") came from this on one H100.
set -u
if [ "${1:-}" = prepare ]; then
  B=${2:?benchmark --out folder}
  M=scripts/.cache/rapidocr_onnxruntime-1.4.4/rapidocr_onnxruntime/models
  grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
  rm -rf .gpu && mkdir -p .gpu && cp $M/ch_PP-OCRv4_det_infer.onnx .gpu/det.onnx && cp $M/ch_ppocr_mobile_v2.0_cls_infer.onnx .gpu/cls.onnx \
    && cp -r $B/ocr_det/work/calib .gpu/det_calib && cp -r $B/ocr_cls/work/calib .gpu/cls_calib && du -sh .gpu
  exit $?
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
{ nvidia-smi -L; nproc
  python3 -c "import sys,torch,onnxruntime; print(sys.version.split()[0], 'torch', torch.__version__, torch.cuda.is_available(), 'ort', onnxruntime.__version__, onnxruntime.get_available_providers())"
} 2>&1 | tee "$O/env.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_brecq.py 2>&1 | tail -25 | tee "$O/pytest.txt"
run() {  # name device model calib N iters timeout
  local t0=$(date +%s.%N)
  timeout "$7" python3 -m dipoorlet -M ".gpu/$3" -I ".gpu/$4" -N "$5" -D trt -O "/tmp/o_$1" --brecq --ada_iters "$6" \
    --recon_device "$2" --skip_prof_layer > "/tmp/o_$1.log" 2>&1
  local rc=$?
  echo "$1 rc=$rc wall=$(python3 -c "print(round($(date +%s.%N)-$t0,1))")s $(grep -c 'brecq block' /tmp/o_$1.log) blocks done" | tee -a "$O/timing.txt"
  grep -E "brecq: " "/tmp/o_$1.log" | tee -a "$O/timing.txt"
}
run cls_cuda cuda cls.onnx cls_calib 64 200 120
run cls_cpu cpu cls.onnx cls_calib 64 200 120
run det_cuda cuda det.onnx det_calib 32 200 150
run det_cpu cpu det.onnx det_calib 32 20 90
