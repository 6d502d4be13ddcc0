#!/usr/bin/env bash
# Installs the peers' wheels a GPU machine lacks, each set into its own folder under /tmp, then runs a command
# with them on PYTHONPATH:
#
#   bash scripts/gpu-peers.sh                                    # install what is here, run nothing
#   bash scripts/gpu-peers.sh python3 benchmarks/lora.py --layers 8
#
# .whl/          trl, datasets, peft, liger-kernel and what they need   -> $SITE (/tmp/site)
# .whl-bnb/      bitsandbytes (slimmed to the CUDA 13 libraries by scripts/slim-wheel.py, so that it fits
#                one GPU job's upload beside .whl-unsloth/)              -> $SITE
# .whl-unsloth/  unsloth, unsloth_zoo and the versions they pin (trl <= 1.15, datasets < 5, ...)
#                                                                        -> $SITE-unsloth
#                Unsloth imports bitsandbytes for bf16 LoRA too: carry .whl-bnb/ with it.
#
# A folder that is absent is skipped and what an earlier run installed from it stays, so the sets can arrive
# one at a time. $SITE-unsloth is not on PYTHONPATH: benchmarks/lora.py
# and context.py put it first for their Unsloth workers only (--unsloth-site, which this passes on to them).
set -uo pipefail
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/site}
install() {  # target folder, wheels...
  local target=$1
  shift
  [ $# -gt 0 ] || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$@"
}
shopt -s nullglob
rc=0
install "$SITE" .whl/*.whl .whl-bnb/*.whl || rc=1
install "$SITE-unsloth" .whl-unsloth/*.whl || rc=1
[ $rc -eq 0 ] || { echo "gpu-peers.sh: a wheel set did not install" >&2; exit 1; }
export PYTHONPATH=$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}
[ $# -gt 0 ] || exit 0
if [[ "$*" == *benchmarks/lora.py* || "$*" == *benchmarks/context.py* ]]; then
  exec "$@" --unsloth-site "$SITE-unsloth"
fi
exec "$@"
