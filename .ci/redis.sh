# Sourced by .ci/run: redis-server and redis-cli for the stream tests (issues #27 and #36;
# tests/support/redis_server.py, tests/support/redis_cluster.py). The tests start private servers on free
# 127.0.0.1 ports from this binary (one per session, restartable ones for the "Redis restarted mid-stream"
# tests, and 3-master + 3-replica clusters joined with `redis-cli --cluster create`); here both are
# installed and checked to run.
REDIS_NEEDED=()
command -v redis-server >/dev/null 2>&1 || REDIS_NEEDED+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || REDIS_NEEDED+=(redis-tools)
if [ "${#REDIS_NEEDED[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${REDIS_NEEDED[@]}" >/dev/null
fi
redis-cli --version >/dev/null
KVAGENT_REDIS_SERVER=$(command -v redis-server)
REDIS_CHECK_DIR=$(mktemp -d)
REDIS_CHECK_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$KVAGENT_REDIS_SERVER" --port "$REDIS_CHECK_PORT" --bind 127.0.0.1 --save "" --appendonly no \
  --dir "$REDIS_CHECK_DIR" >"$REDIS_CHECK_DIR/redis.log" 2>&1 &
REDIS_CHECK_PID=$!
for _ in $(seq 1 100); do
  if redis-cli -p "$REDIS_CHECK_PORT" ping 2>/dev/null | grep -q PONG; then break; fi
  sleep 0.1
done
redis-cli -p "$REDIS_CHECK_PORT" ping | grep -q PONG || { cat "$REDIS_CHECK_DIR/redis.log" >&2; exit 1; }
kill "$REDIS_CHECK_PID"; wait "$REDIS_CHECK_PID" 2>/dev/null || true
rm -rf "$REDIS_CHECK_DIR"
export KVAGENT_REDIS_SERVER
export KVAGENT_REQUIRE_REDIS=1
