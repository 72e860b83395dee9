#!/usr/bin/env bash
# run-controlplane.sh -- the flags, certificates and kubeconfigs of Tandem's local control plane.
#
# Driven by `tandem-e2e cluster up` (e2e/src/cluster/), which orders the components, waits for each
# one's readiness and creates the nodes. Usable by hand too:
#
#   E2E_DIR=/tmp/c ./run-controlplane.sh pki                 # CA, certs, kubeconfigs (idempotent)
#   E2E_DIR=/tmp/c E2E_BIN_DIR=... ./run-controlplane.sh start etcd
#   ... start kube-apiserver | kube-controller-manager | kube-scheduler | kwok
#
# `start` launches one component in its own session (setsid: a Ctrl-C on the caller's terminal does
# not reach it), appends its output to $E2E_DIR/logs/<name>.log and writes "<pid> <starttime>" to
# $E2E_DIR/pids/<name>.pid, where <starttime> is field 22 of /proc/<pid>/stat (clock ticks since
# boot). `tandem-e2e cluster down` signals a pid only while that pair still matches, so a recycled
# pid is never killed. Everything binds 127.0.0.1.
#
# Env: E2E_DIR (state dir, required), E2E_BIN_DIR (for start), ETCD_PORT ETCD_PEER_PORT API_PORT
#      KCM_PORT SCHED_PORT KWOK_PORT (defaults below; `tandem-e2e` passes them explicitly).
# Sources of the flags: reference/controlplane.md sections 3-5 (envtest, kubeadm, kwokctl).
set -euo pipefail

D="$(realpath -m "${E2E_DIR:?set E2E_DIR to the cluster state dir}")"
ETCD_PORT="${ETCD_PORT:-23790}"; ETCD_PEER_PORT="${ETCD_PEER_PORT:-23800}"
API_PORT="${API_PORT:-26443}"; KCM_PORT="${KCM_PORT:-20257}"
SCHED_PORT="${SCHED_PORT:-20259}"; KWOK_PORT="${KWOK_PORT:-20247}"
P="$D/pki"

log() { printf '[controlplane] %s\n' "$*" >&2; }

gen_pki() { # one CA for serving + client certs, a separate RSA key pair for ServiceAccount tokens
  mkdir -p "$P"
  [[ -f "$P/.complete" ]] && return 0
  log "generating certificates in $P"
  ( cd "$P"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -keyout ca.key -out ca.crt \
    -subj "/CN=tandem-e2e-ca" 2>/dev/null
  # rustls (kube-rs) checks the SAN of the address it dials: IP:127.0.0.1 must be there.
  cat >apiserver.ext <<'EOF'
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:10.96.0.1
EOF
  # KCM, scheduler: their /healthz is checked with this CA (tandem-e2e's readiness waits).
  cat >serving.ext <<'EOF'
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:localhost,IP:127.0.0.1
EOF
  cat >client.ext <<'EOF'
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth
EOF
  local name subj ext
  # name|subject|extensions; client certs: CN = user, O = group (x509 authenticator)
  for spec in 'apiserver|/CN=kube-apiserver|apiserver.ext' \
              'serving|/CN=tandem-e2e-components|serving.ext' \
              'admin|/O=system:masters/CN=tandem-e2e-admin|client.ext' \
              'kcm|/CN=system:kube-controller-manager|client.ext' \
              'scheduler|/CN=system:kube-scheduler|client.ext'; do
    IFS='|' read -r name subj ext <<<"$spec"
    openssl req -newkey rsa:2048 -nodes -keyout "$name.key" -out "$name.csr" -subj "$subj" 2>/dev/null
    openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
      -extfile "$ext" -out "$name.crt" 2>/dev/null
  done
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  chmod 600 ./*.key
  touch .complete
  )
  local u
  for u in admin kcm scheduler; do kubeconfig "$u" >"$D/$u.kubeconfig"; done
}

kubeconfig() { # kubeconfig <user>: client-certificate kubeconfig for the local API server
  local u=$1
  cat <<EOF
apiVersion: v1
kind: Config
clusters:
- name: tandem-e2e
  cluster:
    server: https://127.0.0.1:${API_PORT}
    certificate-authority-data: $(base64 -w0 <"$P/ca.crt")
users:
- name: $u
  user:
    client-certificate-data: $(base64 -w0 <"$P/$u.crt")
    client-key-data: $(base64 -w0 <"$P/$u.key")
contexts:
- name: tandem-e2e
  context: {cluster: tandem-e2e, user: $u}
current-context: tandem-e2e
EOF
}

start_bg() { # start_bg <name> cmd...
  local name=$1 pid starttime; shift
  mkdir -p "$D/logs" "$D/pids"
  if [[ -f "$D/pids/$name.pid" ]]; then
    log "$name: $D/pids/$name.pid exists (already started? run 'tandem-e2e cluster down' first)"; exit 1
  fi
  setsid "$@" >>"$D/logs/$name.log" 2>&1 </dev/null &
  pid=$!
  starttime="$(awk '{print $22}' "/proc/$pid/stat")"
  echo "$pid $starttime" >"$D/pids/$name.pid"
  log "started $name (pid $pid, log $D/logs/$name.log)"
}

start() {
  local B="${E2E_BIN_DIR:?set E2E_BIN_DIR to the output of build-controlplane.sh}"
  [[ -f "$P/.complete" ]] || gen_pki
  case "$1" in
  etcd)
    mkdir -p "$D/etcd"
    # etcd 3.6 (Debian's 3.4 breaks consistent watches of kube-apiserver >= 1.35: controlplane.md §3)
    start_bg etcd "$B/etcd" --name=tandem-e2e --data-dir="$D/etcd" \
      --listen-client-urls="http://127.0.0.1:$ETCD_PORT" --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
      --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
      --initial-cluster="tandem-e2e=http://127.0.0.1:$ETCD_PEER_PORT" \
      --unsafe-no-fsync=true --quota-backend-bytes=2147483648 --auto-compaction-retention=1 --log-level=warn ;;
  kube-apiserver)
    # Advertise 127.0.0.1 with no endpoint reconciler (the `kubernetes` Endpoints may not be loopback).
    start_bg kube-apiserver "$B/kube-apiserver" \
      --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
      --bind-address=127.0.0.1 --secure-port="$API_PORT" \
      --advertise-address=127.0.0.1 --endpoint-reconciler-type=none \
      --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" \
      --client-ca-file="$P/ca.crt" \
      --service-account-issuer=https://kubernetes.default.svc.cluster.local \
      --service-account-key-file="$P/sa.pub" --service-account-signing-key-file="$P/sa.key" \
      --service-cluster-ip-range=10.96.0.0/16 \
      --authorization-mode=Node,RBAC \
      --allow-privileged=true --profiling=false --v=1 ;;
  kube-controller-manager)
    start_bg kube-controller-manager "$B/kube-controller-manager" \
      --kubeconfig="$D/kcm.kubeconfig" \
      --authentication-kubeconfig="$D/kcm.kubeconfig" --authorization-kubeconfig="$D/kcm.kubeconfig" \
      --use-service-account-credentials=true \
      --bind-address=127.0.0.1 --secure-port="$KCM_PORT" \
      --tls-cert-file="$P/serving.crt" --tls-private-key-file="$P/serving.key" \
      --leader-elect=false --controllers='*' \
      --service-account-private-key-file="$P/sa.key" --root-ca-file="$P/ca.crt" \
      --cluster-signing-cert-file="$P/ca.crt" --cluster-signing-key-file="$P/ca.key" \
      --kube-api-qps=100 --kube-api-burst=200 --v=1 ;;
  kube-scheduler)
    start_bg kube-scheduler "$B/kube-scheduler" \
      --kubeconfig="$D/scheduler.kubeconfig" \
      --authentication-kubeconfig="$D/scheduler.kubeconfig" --authorization-kubeconfig="$D/scheduler.kubeconfig" \
      --bind-address=127.0.0.1 --secure-port="$SCHED_PORT" \
      --tls-cert-file="$P/serving.crt" --tls-private-key-file="$P/serving.key" \
      --leader-elect=false --v=1 ;;
  kwok)
    # Manages only nodes annotated kwok.x-k8s.io/node=fake; process-runner nodes are left alone.
    start_bg kwok "$B/kwok" \
      --kubeconfig="$D/admin.kubeconfig" --config="$B/kwok-stages.yaml" \
      --manage-all-nodes=false \
      --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
      --manage-nodes-with-label-selector= --manage-single-node= \
      --cidr=10.244.0.0/16 --node-ip=10.0.0.1 \
      --node-lease-duration-seconds=40 \
      --server-address="127.0.0.1:$KWOK_PORT" ;;
  *) log "unknown component '$1'"; exit 2 ;;
  esac
}

case "${1:-}" in
  pki) gen_pki; echo "$D" ;;
  start) [[ -n "${2:-}" ]] || { log "usage: $0 start COMPONENT"; exit 2; }; start "$2" ;;
  *) echo "usage: $0 pki | start etcd|kube-apiserver|kube-controller-manager|kube-scheduler|kwok" >&2; exit 2 ;;
esac
