#!/bin/bash
# Usage: bash benchmarks/start_time.sh --compile   (or --enforce-eager); docs/performance.md#start-time
# time from launch to "Blink is serving" for one blink serve command line; kills it after
cd /tmp
start=$(date +%s.%N)
blink serve --port 8877 --dtype bfloat16 --max-num-seqs 16 --max-num-batched-tokens 256 --max-model-len 1024 --kv-cache-tokens 32768 "$@" > /tmp/start_time.log 2>&1 &
pid=$!
for i in $(seq 1 1800); do
  if grep -q "Blink is serving" /tmp/start_time.log; then break; fi
  if ! kill -0 $pid 2>/dev/null; then echo "exited"; break; fi
  sleep 0.5
done
end=$(date +%s.%N)
echo "args: $* -> $(python3 -c "print(round($end - $start, 1))") s to serving"
grep -iE "compil" /tmp/start_time.log | tail -3
kill -INT $pid; wait $pid 2>/dev/null
