#!/bin/bash
# Build the carried bundle that puts vLLM on the borrowed GPU machine for bench/vllm_gpu_vs_model.py.
#
# The device has torch 2.11.0+cu130 and Python 3.12 and no package index; vLLM 0.25.0's CUDA
# wheel pins torch 2.11.0 and is built for CUDA 13 (the 0.32.0 this project pins for CPU needs
# torch 2.13). A call carries at most 64 MiB with the tree, so the bundle travels in 47 MB parts,
# one per call, to a machine kept warm between the calls (30 s idle at most: send the calls in
# one message so no thinking falls between them):
#
#   bench/vllm_gpu_bundle.sh             # here: writes .vw1 .. .vw4 (ignored by git)
#   run carry [.vw1]: mkdir -p /tmp/stash && cp .vw1/part.0 /tmp/stash/
#   run carry [.vw2]: cp .vw2/part.1 /tmp/stash/
#   run carry [.vw3]: cp .vw3/part.2 /tmp/stash/
#   run carry [.vw4]: bash .vw4/go.sh && export PYTHONPATH=/tmp/site:/tmp/site2 &&
#       python3 bench/vllm_gpu_vs_model.py measure --model llama2-7b --rates 5.3,8.5 \
#           --rates-h200 7.2,11.6 --duration 40 --warmup 8 --out $OUT
#
# The wheel is trimmed to what a Llama on a Hopper GPU runs: FlashAttention 2's kernels (FA3 is
# what vLLM picks on sm90), the Rust frontend binary, the CUTLASS headers and the DeepGEMM
# builds for other Pythons are dropped. GPU-only dependencies (flashinfer, cutlass-dsl, tilelang,
# ...) stay behind: a Llama with the FLASH_ATTN backend imports none of them. go.sh installs only
# the dependencies the device's image lacks (or has at another version), into /tmp/site2.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=${WORK:-/tmp/vllm-gpu-bundle}
VER=${VLLM_VERSION:-0.25.0}
PLAT="--python-version 3.12 --implementation cp --only-binary=:all:"
for n in 5 17 24 26 27 28 31 34 35; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 --platform any"
rm -rf "$W" && mkdir -p "$W/deps" "$W/x"
cd "$W"
python3 -m pip download -q --no-deps $PLAT -d . "vllm==$VER"
unzip -q vllm-"$VER"-*.whl -d x
unzip -p vllm-"$VER"-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' | sed 's/;.*//' \
  | grep -v -E '^(torch|torchaudio|torchvision|torchcodec|PyNvVideoCodec|flashinfer|apache-tvm-ffi|tilelang|nvidia-|quack-kernels|tokenspeed-mla|humming-kernels|opencv|numba|fastsafetensors|numpy|transformers|tokenizers|safetensors|sentencepiece|tiktoken)' > reqs.txt
python3 -m pip download -q $PLAT -d deps -r reqs.txt
# what the device's image has, or a Llama never imports (heavy, GPU or telemetry packages)
(cd deps && rm -f torch-* nvidia_* triton-* opencv_* numpy-* transformers-* tokenizers-* sympy-* mpmath-* \
  networkx-* cuda_bindings-* cuda_pathfinder* jinja2-* markupsafe-* fsspec-* huggingface_hub-* hf_xet-* \
  safetensors-* grpcio-* opentelemetry_* googleapis_* sentry_sdk-* kernels-* fastapi_cloud_cli-* rignore-* fastar-*)
rm -f x/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so x/vllm/vllm-rs
rm -rf x/vllm/third_party/fmha_sm100 x/vllm/third_party/deep_gemm/include
rm -f x/vllm/third_party/deep_gemm/_C.cpython-31[01345]*
tar cf - -C x . | xz -T0 -6 > vllm.tar.xz
tar cf bundle.tar vllm.tar.xz deps
split -b 47000000 -d -a 1 bundle.tar part.
cd "$ROOT"
grep -qx '/.vw\*/' .git/info/exclude 2>/dev/null || echo '/.vw*/' >> .git/info/exclude
rm -rf .vw1 .vw2 .vw3 .vw4 .vw5
i=1; for p in "$W"/part.*; do mkdir -p .vw$i; mv "$p" .vw$i/; i=$((i + 1)); done
last=.vw$((i - 1)); n=$((i - 2))
cat > $last/go.sh <<GO
#!/bin/bash
# device side: assemble the bundle's parts (from /tmp/stash, or the .vwN folders still there)
set -e
S=/tmp/stash; mkdir -p \$S; cp $last/part.$n \$S/
for k in \$(seq 0 $((n - 1))); do [ -f \$S/part.\$k ] || cp .vw\$((k + 1))/part.\$k \$S/; done
cd \$S && cat \$(ls part.* | sort -t. -k2 -n) | tar x && rm -f part.*
mkdir -p /tmp/site /tmp/site2 && tar xJf vllm.tar.xz -C /tmp/site
python3 - <<'PY'
import glob, subprocess, importlib.metadata as md
keep = {"packaging","setuptools","six","pyyaml","requests","urllib3","certifi","idna","charset_normalizer",
        "filelock","psutil","pillow","protobuf","tqdm","regex","jinja2","markupsafe","attrs","cffi",
        "pycparser","click","pygments","rich","numpy"}
need = []
for w in sorted(glob.glob('/tmp/stash/deps/*.whl')):
    f = w.split('/')[-1]; name, ver = f.split('-')[0], f.split('-')[1]
    try:
        v = md.version(name)
        if name.lower() in keep or v == ver:
            continue
        print("override", name, v, "->", ver)
    except md.PackageNotFoundError:
        print("missing", name, ver)
    need.append(w)
if need:
    subprocess.check_call(['python3','-m','pip','install','-q','--no-index','--no-deps','--no-compile',
                           '--no-cache-dir','--target','/tmp/site2'] + need)
PY
echo installed
GO
chmod +x $last/go.sh
du -sh .vw*
