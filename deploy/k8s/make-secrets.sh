#!/bin/sh
# Create (or update, after `marduk auth rotate`) the Kubernetes Secrets the manifests mount, from
# a `marduk auth init` directory. One Secret per role, so each pod holds only its own seed:
#   marduk-nats-auth   nats-server.conf (public keys and permissions only; the NATS pods)
#   marduk-controller  controller.nk    (the controllers)
#   marduk-agent       agent.nk, controller.pub (trainers: sign in, verify command signatures)
#   marduk-monitor     monitor.nk       (the monitor daemon)
# admin.nk stays with the operator (`marduk monitor status --nkey admin.nk` through a
# port-forward). Seeds go from the file straight to the API server: never into git, a
# manifest or a command line.
#
#   marduk auth init ./marduk-auth            # once; keep the directory private
#   deploy/k8s/make-secrets.sh ./marduk-auth [NAMESPACE]
set -eu

dir=${1:?usage: make-secrets.sh AUTH_DIR [NAMESPACE]}
ns=${2:-marduk}
for f in nats-server.conf controller.nk agent.nk monitor.nk controller.pub; do
    test -f "$dir/$f" || { echo "error: $dir/$f not found: run \`marduk auth init $dir\`" >&2; exit 1; }
done

# create --dry-run | apply: the same command creates the Secret or replaces its contents.
secret() {
    name=$1
    shift
    kubectl -n "$ns" create secret generic "$name" "$@" --dry-run=client -o yaml \
        | kubectl -n "$ns" apply -f -
}

secret marduk-nats-auth --from-file=nats-server.conf="$dir/nats-server.conf"
secret marduk-controller --from-file=controller.nk="$dir/controller.nk"
secret marduk-agent --from-file=agent.nk="$dir/agent.nk" \
    --from-file=controller.pub="$dir/controller.pub"
secret marduk-monitor --from-file=monitor.nk="$dir/monitor.nk"
