#!/bin/sh
# kind's default CNI, kindnetd, is not served by any reachable registry or by the Go module proxy.
# This stand-in does the part of it that a cluster's pod network needs, from each node's network
# namespace (hostNetwork, NET_ADMIN):
# - writes /etc/cni/net.d/10-kindnet.conflist for this node's spec.podCIDR (ptp + host-local +
#   portmap, as kindnetd does), which makes the kubelet report the node Ready;
# - routes every other node's podCIDR through that node's InternalIP, so pods reach pods across nodes.
# It does not masquerade traffic leaving the cluster and does not enforce NetworkPolicy.
set -eu
: "${NODE_NAME:?}"
SA=/var/run/secrets/kubernetes.io/serviceaccount
# kind adds CONTROL_PLANE_ENDPOINT (host:port on the kind network): the API is reachable before
# kube-proxy programs the Service address.
SERVER="https://${CONTROL_PLANE_ENDPOINT:-${KUBERNETES_SERVICE_HOST}:${KUBERNETES_SERVICE_PORT}}"
CONF=/etc/cni/net.d/10-kindnet.conflist
kc() { kubectl --server="$SERVER" --certificate-authority="$SA/ca.crt" --token="$(cat "$SA/token")" "$@"; }
conflist() {
  cat <<JSON
{
  "cniVersion": "0.3.1",
  "name": "kindnet",
  "plugins": [
    {
      "type": "ptp",
      "ipMasq": false,
      "ipam": {
        "type": "host-local",
        "dataDir": "/run/cni-ipam-state",
        "routes": [{"dst": "0.0.0.0/0"}],
        "ranges": [[{"subnet": "$1"}]]
      },
      "mtu": 1500
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
}
while true; do
  if nodes=$(kc get nodes -o jsonpath='{range .items[*]}{.metadata.name}{" "}{.spec.podCIDR}{" "}{.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}'); then
    echo "$nodes" | while read -r name cidr ip; do
      [ -n "$cidr" ] && [ -n "$ip" ] || continue
      if [ "$name" = "$NODE_NAME" ]; then
        want=$(conflist "$cidr")
        if [ "$(cat "$CONF" 2>/dev/null)" != "$want" ]; then
          echo "$want" >"$CONF.tmp" && mv "$CONF.tmp" "$CONF"
          echo "wrote $CONF for $cidr"
        fi
      elif [ "$(ip route show "$cidr")" != "$cidr via $ip dev eth0 " ] && ip route replace "$cidr" via "$ip"; then
        echo "route $cidr via $ip ($name)"
      fi
    done
  fi
  sleep 5
done
