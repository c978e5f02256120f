# kind's node base image (kind v0.33.0 images/base/Dockerfile), built from the local Debian image
# instead of debian:trixie-slim from Docker Hub, and with Debian bookworm's containerd, runc and CNI
# plugins instead of sources cloned from GitHub. Bookworm, not trixie: its systemd 252 still boots
# on a cgroup v1 host. The context holds kind's images/base/files from kind's own module zip.
ARG DEBIAN_IMAGE
FROM ${DEBIAN_IMAGE}
COPY files/usr/local/bin/ /usr/local/bin/
# Packages first: Debian's containerd ships its own /etc/containerd/config.toml, and dpkg would stop
# to ask which to keep if kind's were already there.
RUN chmod 0755 /usr/local/bin/* \
 && echo "Installing Packages ..." \
 && DEBIAN_FRONTEND=noninteractive clean-install \
      systemd \
      conntrack iptables nftables iproute2 ethtool util-linux mount kmod \
      libseccomp2 pigz fuse-overlayfs \
      e2fsprogs \
      bash ca-certificates curl jq procps \
      containerd runc containernetworking-plugins \
 && find /lib/systemd/system/sysinit.target.wants/ -name "systemd-tmpfiles-setup.service" -delete \
 && rm -f /lib/systemd/system/multi-user.target.wants/* \
 && rm -f /etc/systemd/system/*.wants/* \
 && rm -f /lib/systemd/system/local-fs.target.wants/* \
 && rm -f /lib/systemd/system/sockets.target.wants/*udev* \
 && rm -f /lib/systemd/system/sockets.target.wants/*initctl* \
 && rm -f /lib/systemd/system/basic.target.wants/* \
 && echo "ReadKMsg=no" >> /etc/systemd/journald.conf \
 && ln -sf /usr/lib/systemd/systemd /sbin/init
COPY files/kind/ /kind/
COPY files/etc/ /etc/
# kind's containerd unit starts /usr/local/bin/containerd; its CNI config looks in /opt/cni/bin.
RUN chmod 0755 /kind /kind/bin /kind/bin/* \
 && ln -s /usr/bin/containerd /usr/local/bin/containerd \
 && mkdir -p /opt/cni && ln -s /usr/lib/cni /opt/cni/bin \
 && ctr oci spec \
      | jq '.hooks.createContainer[.hooks.createContainer| length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' \
      | jq 'del(.process.rlimits)' > /etc/containerd/cri-base.json \
 && containerd --version && runc --version
# Hosts whose processes lack CAP_SYS_RESOURCE cannot give a sandbox oom_score_adj -998
# ("can't get final child's PID from pipe: EOF"): restrict it to what the node may set.
RUN sed -i 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' /etc/containerd/config.toml \
 && grep -q 'restrict_oom_score_adj = true' /etc/containerd/config.toml
RUN systemctl enable kubelet.service \
 && systemctl enable containerd.service \
 && systemctl enable undo-mount-hacks.service \
 && systemctl mask systemd-binfmt.service \
 && mkdir -p /etc/kubernetes/manifests
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]
