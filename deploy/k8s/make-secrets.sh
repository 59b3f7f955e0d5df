#!/usr/bin/env bash
# Make the Secrets deploy/k8s's pods mount, as Secret manifests under OUT (default
# deploy/k8s/secrets/, git-ignored), from a trust store (made when absent): an identity (nkey) per
# service kind and per GPU node, NATS's users + per-role permissions, a CA + the NATS servers'
# certificate, the Redis password, the admin's seed for the stream-create Job. Then
# `kubectl apply -f OUT/` (before or after `apply -k`). Run again after adding nodes: it keeps
# the trust store, the CA and the password. The Helm chart makes them itself, in the cluster
# (`gpusched user k8s-secrets --apply`, its bootstrap Job); both come from one table.
#   deploy/k8s/make-secrets.sh gpu01,gpu02,gpu03 [OUT]
# OUT/trust is the trust store (admin's seed included): keep it, privately, for
# `gpusched user add|revoke --trust OUT/trust` and `stream create` as admin.
set -euo pipefail
nodes=${1:?usage: make-secrets.sh NODE[,NODE...] [OUT]}
out=${2:-$(dirname "$0")/secrets}
ns=${GPUSCHED_NAMESPACE:-gpusched}
umask 077
# the servers' names: clients (nats), each pod (routes; mutual TLS with this CA)
exec "${GPUSCHED:-gpusched}" user k8s-secrets --namespace "$ns" --nodes "$nodes" --trust "$out/trust" --out "$out" \
  --tls-hosts "nats,nats.$ns.svc,nats-0.nats,nats-1.nats,nats-2.nats"
