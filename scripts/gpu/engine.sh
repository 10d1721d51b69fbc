# On the GPU machine (carry .gpu1): the engine and TLS benchmarks at 10K tokens of an 8B
# model, into $OUT/engine.txt.
B=/tmp/kvferry
S=$OUT/engine.txt
[ -x $B ] || { python3 -c "import lzma; open('$B','wb').write(lzma.open('.gpu1/kvferry.xz').read())"; chmod +x $B; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader >> $S
for a in "--lanes 2" "--lanes 2 --tls-lanes 2"; do
  echo "== bench remote --provider tcp --tls $a --device cuda --blocks 64" >> $S
  timeout 90 $B bench remote --provider tcp --tls $a --device cuda --blocks 64 2>&1 | grep -i "tls_vs_plain (\|over TLS:\|MiB:" >> $S
done
for pl in "" "--per-layer"; do
  echo "== bench engine --device cuda --blocks 625 --layers 32 --segment-kib 32 $pl" >> $S
  timeout 100 $B bench engine --device cuda --blocks 625 --layers 32 --segment-kib 32 --iters 7 --no-duplex $pl 2>&1 | tail -3 >> $S
done
cat $S
