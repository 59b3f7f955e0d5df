#!/usr/bin/env bash
# Make the Secrets deploy/k8s's pods mount, as Secret manifests under OUT (default
# deploy/k8s/secrets/, git-ignored), from a new trust store: an identity (nkey) per service kind
# and per GPU node, NATS's users + per-role permissions, a CA + the NATS servers' certificate,
# the Redis password. Then `kubectl apply -f OUT/` (once; before or after `apply -k`).
#   deploy/k8s/make-secrets.sh gpu01,gpu02,gpu03 [OUT]
# OUT/trust is the trust store (admin's seed included): keep it, privately, for
# `gpusched user add|revoke --trust OUT/trust` and `stream create` as admin.
set -euo pipefail
nodes=${1:?usage: make-secrets.sh NODE[,NODE...] [OUT]}
out=${2:-$(dirname "$0")/secrets}
ns=${GPUSCHED_NAMESPACE:-gpusched}
gpusched=${GPUSCHED:-gpusched}
services=(admission placement fallback preemptor quota_ledger reconciler projector dashboard reader)

mkdir -p "$out"
umask 077
[ -d "$out/trust" ] || "$gpusched" user init --trust "$out/trust" --nodes "$nodes" > /dev/null
"$gpusched" user nats-auth --trust "$out/trust" --out "$out/auth.conf" > /dev/null
# the servers' names: clients (nats), each pod (routes; mutual TLS with this CA). The certificate
# carries serverAuth and clientAuth (a server dials its routes with it); run again, it keeps the
# CA and reissues a certificate made without clientAuth
"$gpusched" user tls --dir "$out/tls" \
  --hosts "nats,nats.$ns.svc,nats-0.nats,nats-1.nats,nats-2.nats" > /dev/null
[ -f "$out/redis-password" ] || head -c 24 /dev/urandom | base64 | tr -d '\n/+=' > "$out/redis-password"

# secret NAME KEY=FILE...: one Secret manifest on stdout
secret() {
  local name=$1 pair
  shift
  printf 'apiVersion: v1\nkind: Secret\nmetadata: {name: %s, namespace: %s}\ntype: Opaque\ndata:\n' "$name" "$ns"
  for pair in "$@"; do
    printf '  %s: %s\n' "${pair%%=*}" "$(base64 -w0 < "${pair#*=}")"
  done
}

ids=$out/trust/identities
svc=()
for s in "${services[@]}"; do svc+=("$s.nk=$ids/$s.nk" "$s.json=$ids/$s.json"); done
node=()
IFS=, read -ra names <<< "$nodes"
for n in "${names[@]}"; do node+=("$n.nk=$ids/$n.nk" "$n.json=$ids/$n.json"); done

secret nats-auth "auth.conf=$out/auth.conf" > "$out/nats-auth.yaml"
secret nats-tls "ca.pem=$out/tls/ca.pem" "server.pem=$out/tls/server.pem" \
  "server-key.pem=$out/tls/server-key.pem" > "$out/nats-tls.yaml"
secret gpusched-redis "password=$out/redis-password" > "$out/gpusched-redis.yaml"
secret gpusched-creds "${svc[@]}" > "$out/gpusched-creds.yaml"
secret gpusched-node-creds "${node[@]}" > "$out/gpusched-node-creds.yaml"
echo "secrets in $out: kubectl apply -f $out/  (the trust store: $out/trust)"
