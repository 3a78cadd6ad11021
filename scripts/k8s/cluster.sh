#!/usr/bin/env bash
# A single-node Kubernetes v1.37.2 on this machine, in a network namespace of its own (make rehearse-k8s):
#   bash scripts/k8s/cluster.sh start     build what is missing (scripts/k8s/build.sh, Debian's containerd, runc
#                                         and CNI plugins unpacked into the cache), then start it: ~20 s
#   bash scripts/k8s/cluster.sh in CMD..  run CMD inside the cluster's network namespace with KUBECONFIG set
#   bash scripts/k8s/cluster.sh import IMAGE...   copy images from the Docker engine into the cluster's containerd
#   bash scripts/k8s/cluster.sh stop      stop everything it started, restore the host's settings, remove its state
#
# Why each odd piece (docs/kubernetes.md, "The rehearsal's cluster"):
# - the network namespace: the cluster's addresses (node 10.231.0.1, pods 10.244.0.0/24, services 10.96.0.0/24)
#   exist only there; a veth pair with both ends inside it gives the node an interface, and there is no route
#   out: traffic goes to addresses in the namespace or its loopback, never anywhere else. Entered with nsenter
#   --net (`ip netns exec` would remount /sys and hide the cgroup mounts the kubelet needs).
# - kubelet: failCgroupV1 false and the cgroupfs driver (this host is cgroup v1), image garbage collection off
#   (the rehearsal's images are imported, never pulled back), eviction thresholds near zero (a full test disk
#   must not evict the cluster). It sets vm.overcommit_memory, kernel.panic and kernel.panic_on_oops machine-wide:
#   saved before, restored by stop.
# - runc behind a wrapper that clamps a negative oomScoreAdj to 0: root here lacks CAP_SYS_RESOURCE, and runc
#   fails otherwise ("can't get final child's PID from pipe: EOF").
# - storage: a pool of hostPath PersistentVolumes (ReadWriteOnce and ReadWriteMany: one node) made at start; no
#   provisioner is needed for a chart whose claims fit them.
# - DNS: CoreDNS as a process on the node's address (clusterDNS), serving cluster.local only: nothing to forward to.
# - NetworkPolicy: the bridge CNI enforces none, so kube-router's firewall alone (iptables and ipsets on the bridged
#   traffic) runs as a process too. kube-network-policies, SIG Network's agent, needs nftables' queue expression,
#   which this kernel lacks ("add rule ... queue": No such file or directory).
set -euo pipefail
source "$(dirname "$0")/../lib.sh"

K8S_VERSION="${K8S_VERSION:-v1.37.2}"
STATE="${TURNSTREAM_K8S_STATE:-$TURNSTREAM_CACHE/k8s-cluster}"
RUN=/run/turnstream-k8s
NETNS="$RUN/netns"
NODE_IP=10.231.0.1
PEER_IP=10.231.0.2
POD_CIDR=10.244.0.0/24
SERVICE_CIDR=10.96.0.0/24
API_SERVICE_IP=10.96.0.1
NODE_NAME=turnstream-node
PKGS="$TURNSTREAM_CACHE/k8s-debian"
PV_COUNT="${K8S_PV_COUNT:-24}"
SYSCTLS=(vm.overcommit_memory kernel.panic kernel.panic_on_oops)
export KUBECONFIG="$STATE/pki/admin.kubeconfig"

bin_dir() { printf '%s\n' "$TURNSTREAM_CACHE/k8s-$K8S_VERSION/bin"; }
in_ns() { nsenter --net="$NETNS" "$@"; }

# Debian's containerd 1.6, runc 1.1 and the CNI plugins 1.1, unpacked (apt-get download + dpkg-deb -x): nothing
# is installed, no service starts.
debian_packages() {
    [[ -x "$PKGS/usr/bin/containerd" && -x "$PKGS/usr/sbin/runc" && -x "$PKGS/usr/lib/cni/bridge" ]] && return 0
    log "unpacking Debian's containerd, runc and CNI plugins into $PKGS"
    local tmp; tmp="$(mktemp -d)"
    (cd "$tmp" && apt-get download containerd runc containernetworking-plugins >/dev/null 2>&1) || {
        apt-get update -qq >/dev/null
        (cd "$tmp" && apt-get download containerd runc containernetworking-plugins >/dev/null)
    }
    mkdir -p "$PKGS"
    for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$PKGS"; done
    rm -rf "$tmp"
    command -v iptables >/dev/null || {
        log "installing Debian's iptables (kube-proxy's rules inside the namespace)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iptables conntrack >/dev/null
    }
    command -v ipset >/dev/null || {
        log "installing Debian's ipset (kube-router's NetworkPolicy sets inside the namespace)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ipset >/dev/null
    }
}

cert() {  # cert NAME CN [O] [SANS]: a key and a certificate signed by the cluster's CA
    local name="$1" cn="$2" org="${3:-}" sans="${4:-}" subj="/CN=$2"
    [[ -n "$org" ]] && subj="/O=$org/CN=$cn"
    openssl genrsa -out "$STATE/pki/$name.key" 2048 2>/dev/null
    openssl req -new -key "$STATE/pki/$name.key" -subj "$subj" -out "$STATE/pki/$name.csr" 2>/dev/null
    local ext="$STATE/pki/$name.ext"
    printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n' >"$ext"
    [[ -n "$sans" ]] && printf 'subjectAltName=%s\n' "$sans" >>"$ext"
    openssl x509 -req -in "$STATE/pki/$name.csr" -CA "$STATE/pki/ca.crt" -CAkey "$STATE/pki/ca.key" \
        -CAcreateserial -days 30 -extfile "$ext" -out "$STATE/pki/$name.crt" 2>/dev/null
}

kubeconfig() {  # kubeconfig NAME: a kubeconfig for the certificate NAME
    local name="$1"
    cat >"$STATE/pki/$name.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: turnstream
  cluster:
    certificate-authority: $STATE/pki/ca.crt
    server: https://$NODE_IP:6443
users:
- name: $name
  user:
    client-certificate: $STATE/pki/$name.crt
    client-key: $STATE/pki/$name.key
contexts:
- name: turnstream
  context: {cluster: turnstream, user: $name}
current-context: turnstream
EOF
}

pki() {
    [[ -f "$STATE/pki/admin.kubeconfig" ]] && return 0
    mkdir -p "$STATE/pki"
    openssl genrsa -out "$STATE/pki/ca.key" 2048 2>/dev/null
    openssl req -x509 -new -key "$STATE/pki/ca.key" -subj /CN=turnstream-rehearsal-ca -days 30 \
        -out "$STATE/pki/ca.crt" 2>/dev/null
    cert apiserver kube-apiserver "" "IP:$NODE_IP,IP:$API_SERVICE_IP,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    cert apiserver-kubelet kube-apiserver-kubelet-client system:masters
    cert admin admin system:masters
    cert controller-manager system:kube-controller-manager
    cert scheduler system:kube-scheduler
    cert kubelet "system:node:$NODE_NAME" system:nodes "IP:$NODE_IP,DNS:$NODE_NAME"
    cert kube-proxy system:kube-proxy
    openssl genrsa -out "$STATE/pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "$STATE/pki/sa.key" -pubout -out "$STATE/pki/sa.pub" 2>/dev/null
    for name in admin controller-manager scheduler kubelet kube-proxy; do kubeconfig "$name"; done
}

network() {
    mkdir -p "$RUN"
    # a private mount for the namespace's bind file (unshare refuses one under a shared mount)
    if ! mountpoint -q "$RUN"; then mount --bind "$RUN" "$RUN" && mount --make-private "$RUN"; fi
    if [[ ! -e "$NETNS" ]] || ! nsenter --net="$NETNS" true 2>/dev/null; then
        touch "$NETNS"
        unshare --net="$NETNS" true
    fi
    in_ns ip link set lo up
    if ! in_ns ip link show tsk8s0 >/dev/null 2>&1; then
        # both ends inside the namespace: the node has an interface and nothing is connected to the host
        ip link add tsk8s0 type veth peer name tsk8s1
        ip link set tsk8s0 netns "$NETNS"
        ip link set tsk8s1 netns "$NETNS"
        in_ns ip addr add "$NODE_IP/24" dev tsk8s0
        in_ns ip addr add "$PEER_IP/24" dev tsk8s1
        in_ns ip link set tsk8s0 up
        in_ns ip link set tsk8s1 up
        # a route for the services' virtual addresses, so the node's own connections to them reach kube-proxy's
        # rewrite (a local packet needs a route before netfilter changes its destination); it stays inside
        in_ns ip route add "$SERVICE_CIDR" dev tsk8s0
    fi
    in_ns sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1 2>/dev/null || true
}

save_sysctls() {
    [[ -f "$STATE/sysctls.saved" ]] && return 0
    for key in "${SYSCTLS[@]}"; do printf '%s=%s\n' "$key" "$(sysctl -n "$key")"; done >"$STATE/sysctls.saved"
}

restore_sysctls() {
    [[ -f "$STATE/sysctls.saved" ]] || return 0
    while IFS= read -r line; do sysctl -qw "$line" || log "could not restore $line"; done <"$STATE/sysctls.saved"
    rm -f "$STATE/sysctls.saved"
}

daemon() {  # daemon NAME CMD...: started in the namespace, its pid and log under $STATE/run
    local name="$1"; shift
    mkdir -p "$STATE/run" "$STATE/logs"
    if [[ -f "$STATE/run/$name.pid" ]] && kill -0 "$(cat "$STATE/run/$name.pid")" 2>/dev/null; then return 0; fi
    # a session of its own: a caller killed with its process group (timeout, Ctrl-C) must not take the cluster along
    setsid nsenter --net="$NETNS" "$@" >"$STATE/logs/$name.log" 2>&1 < /dev/null &
    echo $! >"$STATE/run/$name.pid"
}

runc_wrapper() {
    mkdir -p "$STATE/bin"
    cat >"$STATE/bin/runc" <<EOF
#!/usr/bin/env bash
# runc, with a negative oomScoreAdj clamped to 0 (root here lacks CAP_SYS_RESOURCE; scripts/k8s/cluster.sh)
bundle=""
args=("\$@")
for ((i = 0; i < \${#args[@]}; i++)); do
    case "\${args[i]}" in --bundle|-b) bundle="\${args[i+1]:-}" ;; --bundle=*) bundle="\${args[i]#--bundle=}" ;; esac
done
if [[ -n "\$bundle" && -f "\$bundle/config.json" ]]; then
    python3 -c 'import json,sys
p=sys.argv[1]; c=json.load(open(p)); proc=c.get("process") or {}
if proc.get("oomScoreAdj", 0) < 0:
    proc["oomScoreAdj"]=0; json.dump(c, open(p, "w"))' "\$bundle/config.json"
fi
exec "$PKGS/usr/sbin/runc" "\$@"
EOF
    chmod +x "$STATE/bin/runc"
}

containerd_config() {
    mkdir -p "$STATE/containerd" "$STATE/cni/net.d"
    cat >"$STATE/containerd/config.toml" <<EOF
version = 2
root = "$STATE/containerd/root"
state = "$RUN/containerd"
[grpc]
  address = "$RUN/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$PKGS/usr/lib/cni"
    conf_dir = "$STATE/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      BinaryName = "$STATE/bin/runc"
      SystemdCgroup = false
EOF
    cat >"$STATE/cni/net.d/10-turnstream.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "turnstream",
  "plugins": [
    {"type": "bridge", "bridge": "tsk8s-br0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}},
    {"type": "loopback"}
  ]
}
EOF
}

kubelet_config() {
    mkdir -p "$STATE/kubelet"
    printf 'nameserver %s\nsearch cluster.local\n' "$NODE_IP" >"$STATE/kubelet/resolv.conf"
    cat >"$STATE/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $STATE/pki/ca.crt}
authorization: {mode: Webhook}
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://$RUN/containerd/containerd.sock
clusterDNS: [$NODE_IP]
clusterDomain: cluster.local
resolvConf: $STATE/kubelet/resolv.conf
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 50Mi, nodefs.available: "1%", nodefs.inodesFree: "1%", imagefs.available: "1%"}
tlsCertFile: $STATE/pki/kubelet.crt
tlsPrivateKeyFile: $STATE/pki/kubelet.key
serializeImagePulls: false
maxPods: 60
EOF
}

pv_pool() {
    local manifest="$STATE/pv-pool.yaml"
    : >"$manifest"
    for i in $(seq 1 "$PV_COUNT"); do
        mkdir -p "$STATE/volumes/pv-$i"
        chmod 0777 "$STATE/volumes/pv-$i"
        cat >>"$manifest" <<EOF
---
apiVersion: v1
kind: PersistentVolume
metadata: {name: rehearsal-pv-$i, labels: {turnstream.rehearsal: "true"}}
spec:
  capacity: {storage: 20Gi}
  accessModes: [ReadWriteOnce, ReadWriteMany]
  persistentVolumeReclaimPolicy: Retain
  hostPath: {path: $STATE/volumes/pv-$i, type: Directory}
EOF
    done
    in_ns "$(bin_dir)/kubectl" apply -f "$manifest" >/dev/null
}

coredns() {
    cat >"$STATE/Corefile" <<EOF
.:53 {
    bind $NODE_IP
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $STATE/pki/admin.kubeconfig
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 10
}
EOF
    daemon coredns "$(bin_dir)/coredns" -conf "$STATE/Corefile"
}

netpol() {
    daemon netpol "$(bin_dir)/kube-router" --run-firewall=true --run-router=false --run-service-proxy=false \
        --enable-cni=false --enable-ipv6=false --kubeconfig="$KUBECONFIG" --hostname-override="$NODE_NAME" \
        --metrics-port=0 --health-port=0 --v=1
}

start() {
    [[ "$(id -u)" == 0 ]] || die "the cluster needs root (network namespace, containerd, kubelet)"
    bash "$REPO_ROOT/scripts/k8s/build.sh" >/dev/null
    debian_packages
    local B; B="$(bin_dir)"
    mkdir -p "$STATE"
    pki
    network
    save_sysctls
    # the pods' network namespaces: containerd makes one per pod sandbox under /var/run/netns (cni-*) and leaves it
    # when the cluster stops under it; stop removes those that were not there before
    [[ -f "$STATE/netns.before" ]] || { ls /var/run/netns 2>/dev/null || true; } >"$STATE/netns.before"
    runc_wrapper
    containerd_config
    kubelet_config
    local t0; t0=$(date +%s)
    daemon etcd "$B/etcd" --data-dir "$STATE/etcd" --listen-client-urls http://127.0.0.1:2379 \
        --advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380 \
        --initial-advertise-peer-urls http://127.0.0.1:2380 --initial-cluster default=http://127.0.0.1:2380
    daemon apiserver "$B/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
        --advertise-address="$NODE_IP" --bind-address=0.0.0.0 --secure-port=6443 \
        --service-cluster-ip-range="$SERVICE_CIDR" --allow-privileged=true \
        --client-ca-file="$STATE/pki/ca.crt" --tls-cert-file="$STATE/pki/apiserver.crt" \
        --tls-private-key-file="$STATE/pki/apiserver.key" \
        --kubelet-client-certificate="$STATE/pki/apiserver-kubelet.crt" \
        --kubelet-client-key="$STATE/pki/apiserver-kubelet.key" \
        --service-account-key-file="$STATE/pki/sa.pub" --service-account-signing-key-file="$STATE/pki/sa.key" \
        --service-account-issuer=https://kubernetes.default.svc.cluster.local \
        --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
        --kubelet-preferred-address-types=InternalIP  # the node name resolves nowhere: its address
    wait_for 90 in_ns "$B/kubectl" get --raw /readyz || { tail -30 "$STATE/logs/apiserver.log" >&2; die "kube-apiserver did not answer"; }
    daemon controller-manager "$B/kube-controller-manager" --kubeconfig="$STATE/pki/controller-manager.kubeconfig" \
        --service-account-private-key-file="$STATE/pki/sa.key" --root-ca-file="$STATE/pki/ca.crt" \
        --cluster-signing-cert-file="$STATE/pki/ca.crt" --cluster-signing-key-file="$STATE/pki/ca.key" \
        --use-service-account-credentials=true --leader-elect=false
    daemon scheduler "$B/kube-scheduler" --kubeconfig="$STATE/pki/scheduler.kubeconfig" --leader-elect=false
    daemon containerd "$PKGS/usr/bin/containerd" --config "$STATE/containerd/config.toml"
    wait_for 30 test -S "$RUN/containerd/containerd.sock" || die "containerd did not start"
    pause_image
    daemon kubelet "$B/kubelet" --config="$STATE/kubelet/config.yaml" \
        --kubeconfig="$STATE/pki/kubelet.kubeconfig" --root-dir="$STATE/kubelet/root" \
        --node-ip="$NODE_IP" --hostname-override="$NODE_NAME"
    daemon kube-proxy "$B/kube-proxy" --kubeconfig="$STATE/pki/kube-proxy.kubeconfig" \
        --cluster-cidr="$POD_CIDR" --proxy-mode=iptables --hostname-override="$NODE_NAME" \
        --conntrack-max-per-core=0
    coredns
    wait_for 120 node_ready || { tail -30 "$STATE/logs/kubelet.log" >&2; die "the node did not become Ready"; }
    pv_pool
    netpol
    log "Kubernetes $K8S_VERSION up in $(( $(date +%s) - t0 )) s (node $NODE_IP, KUBECONFIG=$KUBECONFIG)"
}

node_ready() {
    [[ "$(in_ns "$(bin_dir)/kubectl" get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]
}

ctr() { "$PKGS/usr/bin/ctr" --address "$RUN/containerd/containerd.sock" -n k8s.io "$@"; }

# The sandbox image, built here: a static `pause` (the kubelet's pod sandbox) from Go, packed as an image by Docker.
pause_image() {
    ctr images ls -q | grep -qx registry.k8s.io/pause:3.10 && return 0
    local dir; dir="$(mktemp -d)"
    cat >"$dir/main.go" <<'EOF'
package main

import (
	"os"
	"os/signal"
	"syscall"
)

// The pod sandbox's process: holds the namespaces, reaps nothing, exits on SIGINT/SIGTERM.
func main() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGINT, syscall.SIGTERM)
	<-c
}
EOF
    printf 'module pause\n\ngo 1.24\n' >"$dir/go.mod"
    (cd "$dir" && CGO_ENABLED=0 GOFLAGS=-buildvcs=false go build -ldflags "-s -w" -o pause .)
    printf 'FROM scratch\nCOPY pause /pause\nENTRYPOINT ["/pause"]\n' >"$dir/Dockerfile"
    bash "$REPO_ROOT/scripts/rehearse/engine.sh" start >&2
    eval "$(bash "$REPO_ROOT/scripts/rehearse/engine.sh" env)"
    docker build -q -t registry.k8s.io/pause:3.10 "$dir" >/dev/null
    docker save registry.k8s.io/pause:3.10 | ctr images import - >/dev/null
    rm -rf "$dir"
}

import_images() {
    bash "$REPO_ROOT/scripts/rehearse/engine.sh" start >&2
    eval "$(bash "$REPO_ROOT/scripts/rehearse/engine.sh" env)"
    for image in "$@"; do
        log "importing $image into the cluster's containerd"
        docker save "$image" | ctr images import - >/dev/null
    done
}

stop() {
    for name in netpol kube-proxy kubelet coredns scheduler controller-manager apiserver etcd; do
        [[ -f "$STATE/run/$name.pid" ]] || continue
        kill "$(cat "$STATE/run/$name.pid")" 2>/dev/null || true
    done
    # the pods' containers (their shims outlive the kubelet), then containerd
    if [[ -S "$RUN/containerd/containerd.sock" ]]; then
        for task in $(ctr tasks ls -q 2>/dev/null); do ctr tasks kill -s SIGKILL "$task" 2>/dev/null || true; done
        sleep 1
        for task in $(ctr tasks ls -q 2>/dev/null); do ctr tasks delete -f "$task" 2>/dev/null || true; done
    fi
    # whatever is left of the pods (containerd may be gone already): every process in the kubelet's cgroups, then
    # the shims, then the cgroups themselves
    find /sys/fs/cgroup/pids -path '*kubepods*' -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u \
        | xargs -r kill -9 2>/dev/null || true
    pkill -9 -f "containerd-shim-runc-v2 -namespace k8s.io .*-address $RUN/containerd" 2>/dev/null || true
    sleep 1
    for d in /sys/fs/cgroup/*/kubepods; do
        [[ -d "$d" ]] && find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null || true
    done
    [[ -f "$STATE/run/containerd.pid" ]] && kill "$(cat "$STATE/run/containerd.pid")" 2>/dev/null || true
    sleep 1
    for name in netpol kube-proxy kubelet coredns scheduler controller-manager apiserver etcd containerd; do
        [[ -f "$STATE/run/$name.pid" ]] && kill -9 "$(cat "$STATE/run/$name.pid")" 2>/dev/null || true
        rm -f "$STATE/run/$name.pid"
    done
    restore_sysctls
    # the kubelet's mounts (secrets, projected volumes) and the network namespace
    grep -o " $STATE/kubelet/root[^ ]*" /proc/mounts | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
    if [[ -e "$NETNS" ]]; then umount "$NETNS" 2>/dev/null || true; rm -f "$NETNS"; fi
    if [[ -f "$STATE/netns.before" ]]; then
        for ns in /var/run/netns/cni-*; do
            [[ -e "$ns" ]] || continue
            grep -qxF "$(basename "$ns")" "$STATE/netns.before" && continue
            umount "$ns" 2>/dev/null || true
            rm -f "$ns"
        done
        rm -f "$STATE/netns.before"
    fi
    grep -o " $RUN[^ ]*" /proc/mounts | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
    rm -rf "$RUN" /var/lib/cni/networks/turnstream /var/lib/cni/results/turnstream-* /var/log/pods /var/log/containers
    rm -rf "$STATE/etcd" "$STATE/kubelet" "$STATE/volumes" "$STATE/containerd/root" "$STATE/run" "$STATE/pki"
    log "cluster stopped; host settings restored"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    in) shift; exec nsenter --net="$NETNS" env KUBECONFIG="$KUBECONFIG" PATH="$(bin_dir):$PATH" "$@" ;;
    import) shift; import_images "$@" ;;
    *) die "usage: $0 start|stop|in CMD...|import IMAGE..." ;;
esac
