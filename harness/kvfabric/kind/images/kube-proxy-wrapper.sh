#!/bin/sh
# kube-proxy must program the same iptables backend (legacy or nft) as the rest of the node: kind's
# entrypoint chose one from the rules it found, as upstream's kube-proxy image does through
# kubernetes-sigs/iptables-wrappers. Same rule: the backend holding more rules wins, legacy on a tie.
legacy=$( (iptables-legacy-save; ip6tables-legacy-save) 2>/dev/null | grep -c '^-')
nft=$( (timeout 5 sh -c 'iptables-nft-save; ip6tables-nft-save') 2>/dev/null | grep -c '^-')
mode=nft; [ "${legacy:-0}" -ge "${nft:-0}" ] && mode=legacy
update-alternatives --set iptables "/usr/sbin/iptables-$mode" >/dev/null
update-alternatives --set ip6tables "/usr/sbin/ip6tables-$mode" >/dev/null
exec /usr/local/bin/kube-proxy.real "$@"
