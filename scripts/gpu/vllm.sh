# On the GPU machine (carry .gpu2, right after .gpu1's call): installs vLLM 0.26 into
# /tmp/site and the kvferry wheel into /tmp/kvsite, then runs the vLLM benchmark:
#   v  10K tokens, synchronous scheduling: ref, kv-sync, kv-sync-grouped, kv-sync-early
#   a  10K tokens, vLLM's default async scheduling: ref, kv-first, kv-async
#   s  the serving run: serve-ref, serve-kv
#   x "ARGS"  any bench_vllm arguments
M=$1
mkdir -p /tmp/vp && cp .gpu2/vp/* /tmp/vp/
if [ ! -f /tmp/site.done ]; then
  bash /tmp/vp/install.sh /tmp/vp /tmp/site > /tmp/install.txt 2>&1 && touch /tmp/site.done
  tail -12 /tmp/install.txt
fi
rm -rf /tmp/kvsite; python3 -m pip install -q --no-index --no-deps --target /tmp/kvsite .gpu2/*.whl
[ -x /tmp/kvferry ] || { python3 -c "import lzma; open('/tmp/kvferry','wb').write(lzma.open('.gpu2/kvferry.xz').read())"; chmod +x /tmp/kvferry; }
export PYTHONPATH=/tmp/kvsite:/tmp/site
rm -rf /tmp/bv
case $M in
  v) A="--tokens 10000 --no-async-scheduling --phases ref,kv-sync,kv-sync-grouped,kv-sync-early" ;;
  a) A="--tokens 10000 --phases ref,kv-first,kv-async" ;;
  s) A="--phases serve-ref,serve-kv" ;;
  *) A="$2" ;;
esac
timeout ${T:-560} python3 -m kvferry.bench_vllm --kvferry-bin /tmp/kvferry $A --out /tmp/bv --json > $OUT/bv-$M.json 2> /tmp/bv.err
echo rc=$?
[ -s $OUT/bv-$M.json ] || cp /tmp/bv/bench-vllm.json $OUT/bv-$M.json
grep '\[bench-vllm\]' /tmp/bv.err | tail -40
grep -v '\[bench-vllm\]' /tmp/bv.err | tail -20
python3 - "$OUT/bv-$M.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(json.dumps({k: d.get(k) for k in ("ttft_ms", "correctness", "serve")}, indent=1))
PY
