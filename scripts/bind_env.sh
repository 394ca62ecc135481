# Sourced by scripts/serve.sh: make the KV data plane of the stage processes listen on their
# bootstrap_host only. Mooncake 0.3.13's TCP transport and handshake listeners bind the wildcard
# address whatever its settings say, so a tiny preload library (scripts/bind_shim.c, built by
# scripts/setup.sh) turns Mooncake's wildcard binds into binds on the address kvtransfer gives it
# (PD_BIND_ADDR, set by kvtransfer/link/engine.py from bootstrap_host before the engine starts).
BIND_SHIM="$ROOT/.venv/lib/pd_bind_shim.so"
if [ -f "$BIND_SHIM" ]; then
  export LD_PRELOAD="$BIND_SHIM${LD_PRELOAD:+:$LD_PRELOAD}"
else
  echo "[serve] warning: $BIND_SHIM missing (run scripts/setup.sh): the KV data plane will" \
       "listen on every interface" >&2
fi
